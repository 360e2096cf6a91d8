"""Multi-turn code tasks: ``--task code-env:PATH``. The model submits code, reads the
failing tests' output and revises, up to ``max_attempts`` submissions.

The problems, their shapes and the sandbox are the single-turn code task's
(:mod:`engine.tasks.code`, ``--task code:PATH``, the same ``--task-arg`` values). Each
reply is a submission: its program runs against the problem's tests in the sandbox;
when every test passes, or after ``max_attempts`` submissions, the episode ends;
otherwise the user answers with the failing tests' output (each failing test's
statement or input and what it raised or printed, at most
:data:`~engine.tasks.code.FEEDBACK_CHARS` characters) and asks for a revision.

Reward: the last submission's share of tests passed, with each test's outcome
(``test_0``...) and each reason a run failed (``error``, ``limit_<name>``) as its
components, as the single-turn task's; an episode that a limit ended before any
submission scores 0 with the component ``no_submission``. Each episode's metrics:
``attempts`` (submissions made), ``solved`` (1 when the last passed every test),
``first_pass_rate`` and ``pass_rate`` (the first and last submission's share).
The conversation is chat messages (a string prompt is the user's first message), so
the served model needs a chat template.

Snippets (``--task-arg snippet_calls=N``, off by default): the model may also call the
tool ``run_python`` with a program of its own, which runs in the same sandbox (without the
problem's tests) and answers with its exit status and output, at most
:data:`~engine.tasks.code.FEEDBACK_CHARS` characters of it; N calls an episode, a call
past them is a tool error (the model reads why and submits). A call is a turn, not a
submission; ``snippet_calls`` in the episode's metrics counts the runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from engine.core.problems import Problem, ProblemSource, RewardBreakdown
from engine.core.trajectory import Trajectory
from engine.envs.messages import ChatEnv, ChatGroup, MessageStep
from engine.envs.tools import ToolResult
from engine.envs.types import Env, EnvContext, EnvGroupBuilder
from engine.errors import ConfigError
from engine.sandbox import Sandbox, SandboxResult
from engine.tasks.code import CODE_ARGS, FEEDBACK_CHARS, CodeCheck, CodeTask
from engine.tasks.dataset import DataFormat, int_arg, known_args
from engine.tasks.render import ChatMessage

__all__ = [
    "CODE_ENV_ARGS",
    "DEFAULT_MAX_ATTEMPTS",
    "REVISE",
    "CodeEnv",
    "CodeEnvGroup",
    "CodeEnvTask",
    "SnippetTool",
    "snippet_report",
]

DEFAULT_MAX_ATTEMPTS: Final = 3
REVISE: Final = "Fix the code and submit the whole program again."
"""The end of each revision prompt, after the failing tests' output."""

CODE_ENV_ARGS: Final[Mapping[str, str]] = {
    "max_attempts": f"submissions per episode, the first included (default {DEFAULT_MAX_ATTEMPTS})",
    "snippet_calls": "runs of the model's own snippets (the run_python tool) per episode "
    "(default 0: no tool)",
    **{k: v for k, v in CODE_ARGS.items() if k != "chat"},
}


def snippet_report(result: SandboxResult, max_chars: int = FEEDBACK_CHARS) -> str:
    """A snippet's run as the model reads it: how it ended, then its stdout and stderr,
    at most ``max_chars`` characters in all."""
    parts = [result.reason + (" (output cut short)" if result.truncated else "")]
    parts += [
        f"{name}:\n{text}"
        for name, text in (("stdout", result.stdout), ("stderr", result.stderr))
        if text
    ]
    text = "\n".join(parts)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


class SnippetTool:
    """The ``run_python`` tool of one episode: the model's own program run in
    ``sandbox``, at most ``max_calls`` times (a :class:`~engine.envs.tools.Tool`)."""

    name = "run_python"
    description = (
        "Run a Python program in a sandbox (no network, no files of yours) and read how it "
        "ended and what it printed. It does not run the tests: submit the program for that."
    )
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the Python program"}},
        "required": ["code"],
    }

    def __init__(self, sandbox: Sandbox, max_calls: int) -> None:
        self.sandbox = sandbox
        self.max_calls = max_calls
        self.calls = 0

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("run_python takes one argument, code: the program as a string")
        if self.calls >= self.max_calls:
            raise RuntimeError(
                f"no runs left ({self.max_calls} an episode): submit the whole program"
            )
        self.calls += 1
        result = await self.sandbox.run_python(code)
        return ToolResult([{"role": "tool", "name": self.name, "content": snippet_report(result)}])


class CodeEnv:
    """One episode: submissions of one problem (a
    :class:`~engine.envs.messages.MessageEnv`), and its snippet tool when it has one."""

    def __init__(
        self, task: CodeTask, problem: Problem, max_attempts: int, snippet_calls: int = 0
    ) -> None:
        self.task = task
        self.problem = problem
        self.max_attempts = max_attempts
        self.checks: list[CodeCheck] = []
        self.snippets = SnippetTool(task.sandbox, snippet_calls) if snippet_calls else None

    async def initial_messages(self) -> Sequence[ChatMessage]:
        return self.task._messages(self.problem)

    async def respond(self, messages: Sequence[ChatMessage]) -> MessageStep:
        check = await self.task.check(str(messages[-1].get("content") or ""), self.problem)
        self.checks.append(check)
        if all(check.outcomes) or len(self.checks) >= self.max_attempts:
            metrics = {
                "attempts": float(len(self.checks)),
                "solved": float(all(check.outcomes)),
                "first_pass_rate": self.checks[0].share,
                "pass_rate": check.share,
            }
            if self.snippets is not None:
                metrics["snippet_calls"] = float(self.snippets.calls)
            return MessageStep(done=True, metrics=metrics)
        return MessageStep(messages=[{"role": "user", "content": f"{check.feedback()}\n{REVISE}"}])

    def reward(self) -> RewardBreakdown:
        """The last submission's reward (0, ``no_submission``, when there was none)."""
        if not self.checks:
            return RewardBreakdown(0.0, {"no_submission": 1.0})
        return self.checks[-1].breakdown()


class CodeEnvGroup(ChatGroup):
    """A problem's episodes; each one's group reward is its last submission's. Each
    episode has its own snippet tool (its own budget of calls), when it has one."""

    async def make_envs(self) -> Sequence[Env]:
        envs: list[Env] = []
        for env in self.envs:
            assert isinstance(env, CodeEnv)
            tools = [env.snippets] if env.snippets is not None else []
            envs.append(ChatEnv(env, self.context, tools=tools, parser=self.parser))
        return envs

    async def compute_group_rewards(
        self, trajectories: Sequence[Trajectory], envs: Sequence[Env]
    ) -> Sequence[RewardBreakdown]:
        rewards = []
        for env in envs:
            assert isinstance(env, ChatEnv) and isinstance(env.env, CodeEnv)
            rewards.append(env.env.reward())
        return rewards


class CodeEnvTask:
    """Problems with tests, solved over up to ``max_attempts`` submissions with the
    failing tests' output between them (see the module docstring). Build it with
    :meth:`from_args` (what ``--task code-env:PATH`` with ``--task-arg KEY=VALUE``
    does) or from a :class:`~engine.tasks.code.CodeTask`."""

    skip_special_tokens = True

    def __init__(
        self,
        problems: CodeTask,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        snippet_calls: int = 0,
    ) -> None:
        if max_attempts < 1:
            raise ConfigError(f"task argument max_attempts must be >= 1, got {max_attempts}")
        if snippet_calls < 0:
            raise ConfigError(f"task argument snippet_calls must be >= 0, got {snippet_calls}")
        self.problems = problems
        self.max_attempts = max_attempts
        self.snippet_calls = snippet_calls
        self.name = problems.name.replace("code-", "code-env-", 1)
        self.stop = problems.stop
        self.chat_template_options = problems.chat_template_options
        self.data_digest = problems.data_digest
        spec, args = problems.spec
        self.spec = (
            spec.replace("code:", "code-env:", 1),
            {
                **args,
                "max_attempts": str(max_attempts),
                **({"snippet_calls": str(snippet_calls)} if snippet_calls else {}),
            },
        )

    @classmethod
    def from_args(cls, path: str, args: Mapping[str, str]) -> CodeEnvTask:
        """Build from ``--task-arg`` strings (see :data:`CODE_ENV_ARGS`)."""
        fmt: DataFormat = "hf" if args.get("format") == "hf" else "jsonl"
        known_args(args, CODE_ENV_ARGS, fmt, "code-env (episodes are chat messages: no chat)")
        rest = {k: v for k, v in args.items() if k not in ("max_attempts", "snippet_calls")}
        attempts = int_arg(args, "max_attempts") if "max_attempts" in args else None
        return cls(
            CodeTask.from_args(path, rest),
            DEFAULT_MAX_ATTEMPTS if attempts is None else attempts,
            int_arg(args, "snippet_calls") if "snippet_calls" in args else 0,
        )

    def __repr__(self) -> str:
        return (
            f"CodeEnvTask({self.problems!r}, max_attempts={self.max_attempts}, "
            f"snippet_calls={self.snippet_calls})"
        )

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> ProblemSource:
        return self.problems.source(seed, state)

    def eval_problems(self) -> list[Problem]:
        """The code task's held-out problems."""
        return self.problems.eval_problems()

    def group_builder(
        self, problem: Problem, group_size: int, context: EnvContext
    ) -> EnvGroupBuilder:
        envs = [
            CodeEnv(self.problems, problem, self.max_attempts, self.snippet_calls)
            for _ in range(group_size)
        ]
        return CodeEnvGroup(envs, context)
