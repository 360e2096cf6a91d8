"""Train agents as they are: an OpenAI-compatible endpoint that captures every call of an
agent into an episode (docs/agents.md).

:class:`AgentTask` trains an agent function (``async def episode(client, problem)``,
``client`` an ``openai.AsyncOpenAI``); ``--task agent-cmd:COMMAND`` an agent process
(:mod:`engine.agents.process`); ``python -m engine.serve`` serves a checkpoint on the
same endpoint.
"""

from engine.agents.chat import Answer, ChatFormat, Choice, Conversation
from engine.agents.endpoint import Endpoint, EndpointLimits, serve_endpoint
from engine.agents.episodes import AgentEnv, AgentError, AgentResult, Episode
from engine.agents.task import AgentGroup, AgentTask
from engine.agents.wire import EndpointError

__all__ = [
    "AgentEnv",
    "AgentError",
    "AgentGroup",
    "AgentResult",
    "AgentTask",
    "Answer",
    "ChatFormat",
    "Choice",
    "Conversation",
    "Endpoint",
    "EndpointError",
    "EndpointLimits",
    "Episode",
    "serve_endpoint",
]
