"""The episode API without a server: token bookkeeping (prefix merging, masks, a
broken prefix), the episode runner's limits and outcomes, the chat layer's tools and
tool-call parsing, and the group-scoring hook."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
from env_support import (
    CountdownEnv,
    GuessEnv,
    RankedGroup,
    ScriptedSampler,
    add,
    block,
    chat_context,
    explode,
    hang,
)

from engine.core.datums import group_datums, trajectory_datums
from engine.core.problems import Problem
from engine.core.trajectory_json import episode_record, trajectory_from_dict, trajectory_to_dict
from engine.envs import ChatGroup, EpisodeLimits, HermesToolCalls, Trajectory, Turn
from engine.envs.rollout import EpisodeRunner
from tests.datums import datum_to_dict

pytestmark = pytest.mark.anyio

PROBLEM = Problem(0, "q", None)


def turn(obs: list[int], action: list[int], version: int = 0, lp: float = -0.5) -> Turn:
    return Turn(tuple(obs), tuple(action), (lp,) * len(action), version, "stop")


# -- token bookkeeping ---------------------------------------------------------------


def test_a_single_turn_trajectory_is_the_quickstart_datum() -> None:
    prompt, action = [1, 2, 3], [4, 5]
    (ours,) = trajectory_datums(Trajectory((turn(prompt, action),)), 0.75)
    assert datum_to_dict(ours) == {
        "model_input": [1, 2, 3, 4],  # full[:-1]
        "target_tokens": [2, 3, 4, 5],  # full[1:]
        "weights": [0.0, 0.0, 1.0, 1.0],  # zero over the first len(prompt) - 1 positions
        "logprobs": [0.0, 0.0, -0.5, -0.5],
        "advantages": [0.0, 0.0, 0.75, 0.75],
    }


def test_turns_that_extend_the_prefix_merge_into_one_datum_with_observation_masked() -> None:
    t1 = turn([1, 2], [3, 4], lp=-0.1)
    t2 = turn([1, 2, 3, 4, 9, 9], [5], version=1, lp=-0.2)  # obs = obs1 + act1 + env tokens
    (d,) = trajectory_datums(Trajectory((t1, t2)), 2.0)
    got = datum_to_dict(d)
    assert got["model_input"] == [1, 2, 3, 4, 9, 9]
    assert got["target_tokens"] == [2, 3, 4, 9, 9, 5]
    assert got["weights"] == [0, 1, 1, 0, 0, 1]  # actions trained, env tokens not
    assert got["logprobs"] == pytest.approx([0, -0.1, -0.1, 0, 0, -0.2])
    assert got["advantages"] == [0, 2, 2, 0, 0, 2]


def test_a_broken_prefix_starts_a_new_datum() -> None:
    t1 = turn([1, 2], [3])
    t2 = turn([7, 8], [9])  # the context was rewritten: does not extend [1, 2, 3]
    t3 = turn([7, 8, 9, 6], [5])  # extends t2 again
    first, second = trajectory_datums(Trajectory((t1, t2, t3)), 1.0)
    assert datum_to_dict(first)["model_input"] == [1, 2]
    assert datum_to_dict(second)["model_input"] == [7, 8, 9, 6]
    assert datum_to_dict(second)["weights"] == [0, 1, 0, 1]


def test_masked_episodes_leave_the_baseline_and_the_datums() -> None:
    good = Trajectory((turn([1], [2]),), group_reward=_reward(1.0))
    bad = Trajectory((turn([1], [3]),), group_reward=_reward(0.0))
    masked = Trajectory((turn([1], [4]),), group_reward=_reward(5.0), masked=True)
    built = group_datums([good, bad, masked])
    assert built.advantages == [0.5, -0.5, 0.0]
    assert built.masked == 1
    assert len(built.datums) == 2


def _reward(total: float) -> Any:
    from engine.core.problems import RewardBreakdown

    return RewardBreakdown(total)


# -- the episode runner --------------------------------------------------------------


async def run(envs: list[Any], replies: list[str], **limits: Any) -> tuple[Trajectory, ...]:
    runner = EpisodeRunner(ScriptedSampler(replies), EpisodeLimits(**limits))
    rollout = await runner.run_group(RankedGroup(envs), PROBLEM)
    assert rollout.error is None, rollout.error
    return rollout.trajectories


async def test_an_episode_runs_turn_by_turn_until_done() -> None:
    (t,) = await run([CountdownEnv(turns=3)], ["ab"])
    assert t.outcome == "done" and len(t.turns) == 3
    assert [len(x.observation) for x in t.turns] == [3, 6, 9]  # "go:" + ("ab" + "|") * k
    assert t.total_reward == 3.0 + 1.0  # per-turn rewards + the group reward (best)
    assert len(trajectory_datums(t, 1.0)) == 1


class TaskRecordingEnv(CountdownEnv):
    """Records the task each step runs in."""

    tasks: list[int]

    def __init__(self, tasks: list[int]) -> None:
        super().__init__(turns=1)
        self.tasks = tasks

    async def step(self, action: Any) -> Any:
        self.tasks.append(anyio.get_current_task().id)
        return await super().step(action)


@pytest.mark.parametrize("limits", [None, EpisodeLimits()])
async def test_single_turn_episodes_step_in_their_groups_task_and_env_episodes_overlap(
    limits: EpisodeLimits | None,
) -> None:
    """Without limits (a reward task: one turn each, its action sampled for the whole
    group at once) the episodes step one after the other in the group's own task: a
    task per episode cost the event loop more than the step. Environment episodes keep a
    task each, so their further turns overlap."""
    tasks: list[int] = []
    runner = EpisodeRunner(ScriptedSampler(["ab"]), limits)
    group = RankedGroup([TaskRecordingEnv(tasks) for _ in range(4)])
    rollout = await runner.run_group(group, PROBLEM)
    assert rollout.error is None and [t.outcome for t in rollout.trajectories] == ["done"] * 4
    if limits is None:
        assert set(tasks) == {anyio.get_current_task().id}
    else:
        assert len(set(tasks)) == 4


async def test_max_turns_cuts_the_episode_with_zero_reward() -> None:
    (t,) = await run([CountdownEnv(turns=10)], ["ab"], max_turns=2)
    assert (t.outcome, len(t.turns), t.zeroed, t.total_reward) == ("max_turns", 2, True, 0.0)


async def test_max_turns_with_mask_leaves_the_episode_out() -> None:
    (t,) = await run([CountdownEnv(turns=10)], ["ab"], max_turns=2, on_limit="mask")
    assert t.masked and not t.zeroed


async def test_the_context_limit_caps_each_action_and_ends_the_episode() -> None:
    sampler = ScriptedSampler(["abcd"])
    runner = EpisodeRunner(sampler, EpisodeLimits(max_tokens=10))
    rollout = await runner.run_group(RankedGroup([CountdownEnv(turns=10)]), PROBLEM)
    (t,) = rollout.trajectories
    assert t.outcome == "max_tokens"
    assert [room for _, _, room in sampler.calls] == [7, 2]  # 10 - len(observation)


async def test_an_episode_timeout_keeps_the_turns_before_it() -> None:
    (t,) = await run([CountdownEnv(turns=5, hang_at=2)], ["ab"], episode_timeout=0.05)
    assert t.outcome == "timeout" and len(t.turns) == 1 and t.zeroed


async def test_an_environment_that_raises_ends_its_episode_not_the_group() -> None:
    envs = [CountdownEnv(turns=2, raise_at=1), CountdownEnv(turns=2)]
    broken, fine = await run(envs, ["ab"])
    assert broken.outcome == "env_error" and "the environment broke" in (broken.error or "")
    assert len(broken.turns) == 1 and broken.total_reward == 0.0  # zeroed
    assert fine.outcome == "done"


async def test_a_group_that_opens_alike_samples_its_first_turn_in_one_request() -> None:
    sampler = ScriptedSampler(["a", "bb", "ccc"])
    runner = EpisodeRunner(sampler, EpisodeLimits())
    group = RankedGroup([CountdownEnv(turns=1) for _ in range(3)])
    rollout = await runner.run_group(group, PROBLEM)
    assert [n for _, n, _ in sampler.calls] == [3]
    # The group hook saw the whole group: the longest reply wins.
    assert [t.group_reward.total for t in rollout.trajectories] == [0.0, 0.0, 1.0]
    assert group.cleaned


async def test_a_broken_prefix_in_an_episode_yields_two_datums() -> None:
    (t,) = await run([CountdownEnv(turns=3, break_prefix_at=1)], ["ab"])
    assert len(trajectory_datums(t, 1.0)) == 2


async def test_a_failing_group_hook_is_a_reward_error_and_cleanup_still_runs() -> None:
    class Failing(RankedGroup):
        async def compute_group_rewards(self, trajectories: Any, envs: Any) -> Any:
            raise RuntimeError("judge down")

    group = Failing([CountdownEnv(turns=1)])
    rollout = await EpisodeRunner(ScriptedSampler(["a"]), None).run_group(group, PROBLEM)
    assert rollout.error is not None and "judge down" in str(rollout.error)
    assert group.cleaned and len(rollout.trajectories) == 1


# -- the chat layer and tools --------------------------------------------------------


async def chat(env: Any, replies: list[str], **limits: Any) -> Trajectory:
    context = chat_context(**limits)
    group = ChatGroup([env], context, [add, hang, block, explode])
    runner = EpisodeRunner(ScriptedSampler(replies), context.limits)
    rollout = await runner.run_group(group, PROBLEM)
    (t,) = rollout.trajectories
    return t


def call(name: str, **arguments: Any) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def test_a_tool_call_is_run_and_its_result_shown_to_the_model() -> None:
    t = await chat(GuessEnv(5), [call("add", a=2, b=3), "5"])
    assert t.outcome == "done" and t.total_reward == 1.0
    first, second = t.turns
    assert first.logs["tool_calls"] == [
        {"name": "add", "arguments": {"a": 2, "b": 3}, "result": ["5"], "error": None}
    ]
    assert first.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}
    assert bytes(second.observation).decode().endswith("<tool>5\n<assistant>")
    assert bytes(second.observation).startswith(bytes(first.observation))  # one datum
    assert len(trajectory_datums(t, 1.0)) == 1


@pytest.mark.parametrize("name", ["hang", "block"])  # async, and a plain blocking function
async def test_a_tool_that_hangs_times_out_as_a_tool_error(name: str) -> None:
    t = await chat(GuessEnv(1), [call(name), "1"], tool_timeout=0.05)
    (result,) = t.turns[0].logs["tool_calls"]
    assert "timed out" in result["error"]
    assert t.turns[0].metrics["tool_errors"] == 1.0
    assert t.outcome == "done"  # the model was told and went on


async def test_a_tool_that_raises_or_does_not_exist_is_a_tool_error() -> None:
    t = await chat(GuessEnv(1), [call("explode") + call("nope"), "1"])
    errors = [r["error"] for r in t.turns[0].logs["tool_calls"]]
    assert "kaboom" in errors[0] and "unknown tool" in errors[1]
    assert "error: ValueError: kaboom" in bytes(t.turns[1].observation).decode()


@pytest.mark.parametrize(
    ("policy", "outcome", "turns"), [("zero", "parse_error", 1), ("retry", "done", 2)]
)
async def test_a_malformed_tool_call_follows_on_parse_error(
    policy: str, outcome: str, turns: int
) -> None:
    t = await chat(GuessEnv(1), ["<tool_call>{oops</tool_call>", "1"], on_parse_error=policy)
    assert (t.outcome, len(t.turns)) == (outcome, turns)
    assert t.turns[0].metrics["parse_errors"] == 1.0


async def test_a_wrong_answer_gets_feedback_until_max_turns() -> None:
    t = await chat(GuessEnv(7), ["1", "2", "3"], max_turns=3)
    assert t.outcome == "max_turns" and len(t.turns) == 3
    assert t.turns[1].logs == {"assistant": "2", "messages": [{"role": "user", "content": "no"}]}


def test_hermes_tool_calls_are_read_in_order_and_bad_ones_reported() -> None:
    parsed = HermesToolCalls().parse(
        'think <tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "b"}'
    )
    assert [(c.name, dict(c.arguments)) for c in parsed.tool_calls] == [("a", {"x": 1}), ("b", {})]
    assert parsed.content == "think" and parsed.error is None
    assert HermesToolCalls().parse('<tool_call>{"arguments": {}}</tool_call>').error


def test_a_function_tool_has_a_json_schema_and_validates_arguments() -> None:
    assert add.parameters == {
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "type": "object",
    }
    with pytest.raises(ValueError, match="invalid arguments for add"):
        anyio.run(add.call, {"a": "x", "b": 1})


async def test_trajectories_round_trip_and_read_turn_by_turn() -> None:
    t = await chat(GuessEnv(5), [call("add", a=2, b=3), "5"])
    assert trajectory_from_dict(trajectory_to_dict(t)) == t
    record = episode_record(t, 0.5, lambda x: bytes(x).decode(), lambda x: bytes(x).decode())
    assert record["turns"][0]["observation"].endswith("<user>guess\n<assistant>")
    assert record["turns"][1]["observation"] == "\n<tool>5\n<assistant>"
    assert record["turns"][1]["new_context"] is False
    assert np.isclose(record["reward"], 1.0)
