"""Multi-turn code tasks (``--task code-env:PATH``): a submission that fails reads the
failing tests' output and revises; the episode ends when every test passes or after
``max_attempts`` submissions, rewarded with the last submission's share of tests passed
and each test's outcome as a component; arguments checked at load; and a pipeline run on
the fake session trains whole episodes whose replies are not code."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from env_support import ChatBytes
from fake_session import FakeSession
from test_code_task import FENCED_ADD, PROBLEMS, problem
from test_pipeline_stages import config, run_pipeline

from engine.catalog import load_task, task_spec
from engine.core.trajectory import Action, StopCondition
from engine.envs import ChatEnv, EnvContext, EnvStepResult, is_env_task
from engine.envs.code import REVISE, CodeEnv, CodeEnvGroup, CodeEnvTask, snippet_report
from engine.errors import ConfigError
from engine.sandbox import SandboxResult
from engine.tasks.render import TaskContext
from tests.sandbox_support import require_isolation

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def isolated() -> Iterator[None]:
    require_isolation()
    yield


@pytest.fixture
def task(isolated: None) -> CodeEnvTask:
    loaded = load_task(f"code-env:{PROBLEMS}", {"timeout": "60", "max_attempts": "3"})
    assert isinstance(loaded, CodeEnvTask)
    return loaded


def context() -> EnvContext:
    return EnvContext(TaskContext(ChatBytes()), StopCondition())


async def play(
    task: CodeEnvTask, index: int, replies: Sequence[str]
) -> tuple[ChatEnv, list[EnvStepResult]]:
    """One episode of problem ``index`` through ``replies`` (its group's only one)."""
    group = task.group_builder(problem(task.problems, index), 1, context())
    (env,) = await group.make_envs()
    assert isinstance(env, ChatEnv)
    await env.initial_observation()
    results = []
    for text in replies:
        result = await env.step(Action(tuple(text.encode())))
        results.append(result)
        if result.done:
            break
    return env, results


def feedback(env: ChatEnv) -> list[str]:
    return [str(m["content"]) for m in env.messages if m["role"] == "user"][1:]


async def test_a_failing_submission_reads_the_failures_and_a_revision_that_passes_ends_it(
    task: CodeEnvTask,
) -> None:
    wrong = "def add(a, b):\n    return a - b"
    env, results = await play(task, 0, [wrong, FENCED_ADD, "never sent"])
    assert [r.done for r in results] == [False, True]
    (said,) = feedback(env)
    assert said.startswith("2 of 3 tests failed.\n")
    assert "test 0: assert add(1, 2) == 3\n-> AssertionError" in said
    assert "test 1: assert add(-1, 1) == 0" in said
    assert "test 2:" not in said  # add(0, 0) == 0 passed
    assert said.endswith(REVISE)
    assert results[-1].metrics == {
        "attempts": 2.0,
        "solved": 1.0,
        "first_pass_rate": pytest.approx(1 / 3),
        "pass_rate": 1.0,
    }
    assert all(r.reward == 0.0 for r in results)  # the reward is the group's
    group = CodeEnvGroup([env.env], context())
    (reward,) = await group.compute_group_rewards([], [env])
    assert reward.total == 1.0 and reward.components == {"test_0": 1, "test_1": 1, "test_2": 1}


async def test_after_max_attempts_the_last_submission_is_rewarded(task: CodeEnvTask) -> None:
    half = "def add(a, b):\n    return a + b if a else 99"
    env, results = await play(task, 0, ["def add(a, b) return", half, half, "never sent"])
    assert len(results) == 3 and results[-1].done
    assert "the program failed to load: SyntaxError" in feedback(env)[0]
    assert results[-1].metrics["solved"] == 0.0
    assert results[-1].metrics["first_pass_rate"] == 0.0
    assert isinstance(env.env, CodeEnv)
    reward = env.env.reward()
    assert reward.total == pytest.approx(2 / 3)
    assert reward.components == {"test_0": 1, "test_1": 1, "test_2": 0}  # add(0, 0) is 99


async def test_stdin_stdout_failures_show_the_input_and_both_outputs(task: CodeEnvTask) -> None:
    env, _ = await play(task, 5, ["a, b = map(int, input().split())\nprint(a + b)"])
    (said,) = feedback(env)
    assert "test 0: input '2 3'\n-> expected '6', got '5'" in said
    assert "test 1: input '-4 5'\n-> expected '-20', got '1'" in said


async def test_a_sandbox_limit_is_in_the_feedback_and_the_reward(isolated: None) -> None:
    task = load_task(f"code-env:{PROBLEMS}", {"timeout": "2", "max_attempts": "1"})
    assert isinstance(task, CodeEnvTask)
    env, (result,) = await play(task, 0, ["while True:\n    pass"])
    assert result.done
    assert isinstance(env.env, CodeEnv)
    assert env.env.checks[0].failures[-1] == "stopped by the sandbox's wall limit"
    assert env.env.reward().components["limit_wall"] == 1.0


def snippet_call(code: str) -> str:
    call = {"name": "run_python", "arguments": {"code": code}}
    return f"Let me try it.\n<tool_call>{json.dumps(call)}</tool_call>"


def tool_results(env: ChatEnv) -> list[str]:
    return [str(m["content"]) for m in env.messages if m["role"] == "tool"]


async def test_snippets_run_in_the_sandbox_without_the_tests_within_their_budget(
    isolated: None,
) -> None:
    task = load_task(f"code-env:{PROBLEMS}", {"timeout": "60", "snippet_calls": "2"})
    assert isinstance(task, CodeEnvTask)
    replies = [
        snippet_call("print(6 * 7)"),
        snippet_call("import os, sys\nprint(sorted(os.listdir('.')))\nsys.exit('bye')"),
        snippet_call("print('a third run')"),
        FENCED_ADD,
    ]
    env, results = await play(task, 0, replies)
    assert [r.done for r in results] == [False, False, False, True]
    first, second, third = tool_results(env)
    assert first == "exit 0\nstdout:\n42\n"
    assert second == "exit 1\nstdout:\n['main.py']\n\nstderr:\nbye\n"  # no tests in sight
    assert third.startswith("error: ") and "no runs left (2 an episode)" in third
    assert results[2].metrics == {"tool_calls": 1.0, "tool_errors": 1.0}
    assert results[-1].metrics["attempts"] == 1.0  # a snippet is no submission
    assert results[-1].metrics["snippet_calls"] == 2.0
    assert results[-1].metrics["solved"] == 1.0


async def test_without_snippet_calls_a_tool_call_is_a_submission(task: CodeEnvTask) -> None:
    env, (result,) = await play(task, 0, [snippet_call("print(1)")])
    assert tool_results(env) == [] and not result.done
    assert isinstance(env.env, CodeEnv) and len(env.env.checks) == 1
    assert "snippet_calls" not in task.spec[1]


def test_a_snippet_report_is_bounded() -> None:
    result = SandboxResult(
        exit_code=None,
        signal="SIGKILL",
        limit="output",
        stdout="y\n" * 5000,
        stderr="",
        stdout_bytes=10000,
        stderr_bytes=0,
        truncated=True,
        wall_s=0.1,
        cpu_s=None,
        isolated=True,
    )
    text = snippet_report(result, 300)
    assert len(text) == 300 and text.endswith("...")
    assert text.startswith("limit output (signal SIGKILL) (output cut short)\nstdout:\ny\n")


def test_feedback_is_bounded_and_names_each_failure() -> None:
    from engine.tasks.code import CodeCheck

    check = CodeCheck([False] * 40, {"error"}, {i: "x" * 1000 for i in range(40)})
    text = check.feedback(2000)
    assert len(text) <= 2000 and text.startswith("40 of 40 tests failed.")
    assert "test 0: " in text and text.count("...") >= 1


def test_the_task_loads_with_its_spec_and_checks_its_arguments(isolated: None) -> None:
    task = load_task(f"code-env:{PROBLEMS}", {"max_attempts": "2", "eval_size": "2"})
    assert is_env_task(task) and isinstance(task, CodeEnvTask)
    assert task.max_attempts == 2 and len(task.eval_problems()) == 2
    spec, args = task_spec(task, "ignored", {})
    assert spec == f"code-env:{PROBLEMS.resolve()}"
    assert args == {"max_attempts": "2", "eval_size": "2"}
    assert isinstance(load_task(spec, args), CodeEnvTask)  # --resume rebuilds it
    assert task.name == "code-env-code_problems"
    with_tool = load_task(f"code-env:{PROBLEMS}", {"snippet_calls": "3"})
    assert isinstance(with_tool, CodeEnvTask) and with_tool.snippet_calls == 3
    spec, args = task_spec(with_tool, "ignored", {})
    assert args["snippet_calls"] == "3" and isinstance(load_task(spec, args), CodeEnvTask)
    for args, message in (
        ({"max_attempts": "0"}, "max_attempts must be >= 1, got 0"),
        ({"max_attempts": "x"}, "max_attempts must be an integer"),
        ({"snippet_calls": "-1"}, "snippet_calls must be >= 0, got -1"),
        ({"chat": "true"}, "unknown task argument 'chat' for code-env"),
        ({"colour": "red"}, "unknown task argument 'colour'"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_task(f"code-env:{PROBLEMS}", args)
    with pytest.raises(ConfigError, match="name the problems"):
        load_task("code-env:")


class ChatSession(FakeSession):
    @property
    def tokenizer(self) -> Any:
        return ChatBytes()


async def test_a_pipeline_run_trains_whole_episodes_of_failed_submissions(
    task: CodeEnvTask,
) -> None:
    small = CodeEnvTask(task.problems, max_attempts=2)
    _, results = await run_pipeline(ChatSession(), config(steps=2), task=small)
    assert len(results) == 2
    episodes = [t for r in results for g in r.groups for t in g.trajectories]
    # the fake sampler's "<version> <i>" is no Python: two submissions, both failing
    assert episodes and all(len(t.turns) == 2 for t in episodes)
    assert all(t.total_reward == 0.0 for t in episodes)
    assert all(t.group_reward.components["error"] == 1.0 for t in episodes)
    assert results[-1].metrics["env/all/attempts"] == 2.0
    assert results[-1].metrics["env/all/solved"] == 0.0


def test_replies_are_read_as_the_single_turn_task_reads_them(isolated: None) -> None:
    task = load_task(f"code-env:{PROBLEMS}", {"stop": "###", "enable_thinking": "false"})
    assert isinstance(task, CodeEnvTask)
    assert task.stop == ("###",) and task.skip_special_tokens
    assert task.chat_template_options == {"enable_thinking": False}
