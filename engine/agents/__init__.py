"""Train agents as they are: an OpenAI-compatible endpoint that captures every call of an
agent into an episode (docs/agents.md).

:class:`AgentTask` trains an agent function (``async def episode(client, problem)``,
``client`` an ``openai.AsyncOpenAI``); ``--task agent-cmd:COMMAND`` an agent process
(:mod:`engine.agents.process`); ``python -m engine.serve`` serves a checkpoint on the
same endpoint.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.agents.chat import Answer, ChatFormat, Choice, Conversation
    from engine.agents.endpoint import Endpoint, EndpointLimits, serve_endpoint
    from engine.agents.episodes import AgentEnv, AgentError, AgentResult, Episode
    from engine.agents.openai_wire import EndpointError
    from engine.agents.task import AgentGroup, AgentTask

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

# Each name's module, imported on first use: a light part (the wire format, the chat
# format: what engine.serve's parser needs) must not load the endpoint's HTTP server.
_HOMES = {
    "engine.agents.chat": ("Answer", "ChatFormat", "Choice", "Conversation"),
    "engine.agents.endpoint": ("Endpoint", "EndpointLimits", "serve_endpoint"),
    "engine.agents.episodes": ("AgentEnv", "AgentError", "AgentResult", "Episode"),
    "engine.agents.task": ("AgentGroup", "AgentTask"),
    "engine.agents.openai_wire": ("EndpointError",),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
