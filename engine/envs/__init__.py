"""Environments: multi-turn episodes and tool use (see docs/environments.md).

The core is token-level (:mod:`engine.envs.types`); :mod:`engine.envs.messages` and
:mod:`engine.envs.tools` are the chat-message layer over it.
"""

from engine.core.trajectory import (
    Action,
    EpisodeLimits,
    Observation,
    OnLimit,
    OnParseError,
    Outcome,
    StopCondition,
    Trajectory,
    Turn,
)
from engine.envs.messages import ChatEnv, ChatGroup, MessageEnv, MessageStep
from engine.envs.tools import (
    FunctionTool,
    HermesToolCalls,
    ParsedReply,
    Tool,
    ToolCall,
    ToolCallParser,
    ToolResult,
    tool,
    tool_schema,
)
from engine.envs.types import Env, EnvContext, EnvGroupBuilder, EnvStepResult, EnvTask, is_env_task

__all__ = [
    "Action",
    "ChatEnv",
    "ChatGroup",
    "Env",
    "EnvContext",
    "EnvGroupBuilder",
    "EnvStepResult",
    "EnvTask",
    "EpisodeLimits",
    "FunctionTool",
    "HermesToolCalls",
    "MessageEnv",
    "MessageStep",
    "Observation",
    "OnLimit",
    "OnParseError",
    "Outcome",
    "ParsedReply",
    "StopCondition",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "Trajectory",
    "Turn",
    "is_env_task",
    "tool",
    "tool_schema",
]
