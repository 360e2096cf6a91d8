"""The shipped environments (guess the sum, the calculator tool): their rules, the
packaged agent model they ask for, and that its chat template renders their
conversations so that every next observation extends the previous observation plus the
sampled reply, in exactly the bytes the model was trained on (scripts/make_model.py's
transcripts)."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine import EngineConfig
from engine.basemodels.catalogue import AGENT_MODEL_DIR, DEFAULT_MODEL_DIR
from engine.catalog import load_task, preferred_local_model
from engine.core.problems import Problem
from engine.engine import prepare_run
from engine.envs import Action, ChatEnv, EnvContext, EnvStepResult, StopCondition, is_env_task
from engine.envs.examples import calculator, guess_sum
from engine.export import base_model_source
from engine.tasks.arithmetic import ArithmeticTask
from engine.tasks.render import TaskContext
from scripts import make_model, tool_data


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The agent model's tokenizer as the build writes it (checked against the shipped one
    below)."""
    return make_model.build_tokenizer(make_model.AGENT_CHAT_TEMPLATE)


def context(tokenizer: Any) -> EnvContext:
    return EnvContext(TaskContext(tokenizer), StopCondition())


def reply(tokenizer: Any, text: str) -> Action:
    """What the sampler returns for ``text``: its bytes, then EOS."""
    return Action((*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id))


async def play(tokenizer: Any, env: ChatEnv, replies: Sequence[str]) -> list[EnvStepResult]:
    """Step ``env`` through ``replies``; every next observation must extend the previous
    observation plus the reply (nothing sampled is re-rendered differently)."""
    observation = (await env.initial_observation()).tokens
    results = []
    for text in replies:
        action = reply(tokenizer, text)
        result = await env.step(action)
        results.append(result)
        if result.done:
            break
        assert result.next_observation is not None
        nxt = result.next_observation.tokens
        assert nxt[: len(observation) + len(action.tokens)] == observation + action.tokens
        observation = nxt
    return results


def problem(a: int, b: int, op: str) -> Problem:
    return Problem(0, f"What is {a} {op} {b}?", a * b if op == "*" else a + b)


def test_the_tasks_run_on_the_packaged_agent_model_unless_one_is_given(tokenizer: Any) -> None:
    shipped = json.loads((AGENT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert shipped["chat_template"] == tokenizer.chat_template == make_model.AGENT_CHAT_TEMPLATE
    assert make_model.AGENT_OUT == AGENT_MODEL_DIR
    for name in ("guess-sum", "calculator"):
        assert preferred_local_model(None, name) == AGENT_MODEL_DIR  # from the spec
        assert preferred_local_model(load_task(name), name) == AGENT_MODEL_DIR
        config, _ = prepare_run(EngineConfig(task=name, local=True), None)
        # recorded by name, so a run dir names no path of this checkout:
        assert config.session.local_model == Path("tiny-agent-2")
        given = EngineConfig(task=name, local=True, local_model=DEFAULT_MODEL_DIR)
        assert prepare_run(given, None)[0].session.local_model == Path("tiny-arith")
    arithmetic = EngineConfig(task="arithmetic", local=True)
    assert prepare_run(arithmetic, None)[0].session.local_model is None
    assert preferred_local_model(None, "no.such.module:Task") is None  # load_task says why
    remote = EngineConfig(task="calculator", base_url="http://127.0.0.1:9", api_key="k")
    # a remote server serves its own models
    assert prepare_run(remote, None)[0].session.local_model is None
    assert base_model_source(make_model.AGENT_MODEL_NAME) == str(AGENT_MODEL_DIR)


def test_the_questions_are_the_arithmetic_tasks_questions() -> None:
    for op, ask in (("+", guess_sum.question), ("*", calculator.question)):
        drawn = ArithmeticTask(op, 10, 99).source(0).next()
        a, b = (int(x) for x in drawn.question.removeprefix("What is ").rstrip("?").split(op))
        assert ask(a, b) == drawn.question


def test_guess_sum_hints_until_solved_and_rewards_fewer_guesses(tokenizer: Any) -> None:
    env = ChatEnv(guess_sum.GuessSumEnv(problem(40, 30, "+"), max_turns=4), context(tokenizer))
    results = anyio.run(play, tokenizer, env, ["75", "68", "70"])
    assert [r.done for r in results] == [False, False, True]
    assert [r.reward for r in results] == [0.0, 0.0, pytest.approx(0.5)]
    assert [m["content"] for m in env.messages if m["role"] == "user"][1:] == [
        guess_sum.TOO_HIGH,
        guess_sum.TOO_LOW,
    ]
    assert results[-1].metrics == {"solved": 1.0, "guesses": 3.0}
    text = tokenizer.decode(list(env._observe().tokens))
    assert "Answer: 75</s>Question: Too high.\nAnswer: 68</s>Question: Too low.\n" in text


def test_guess_sum_ends_unsolved_after_max_turns_or_without_a_number(tokenizer: Any) -> None:
    env = ChatEnv(guess_sum.GuessSumEnv(problem(40, 30, "+"), max_turns=2), context(tokenizer))
    results = anyio.run(play, tokenizer, env, ["75", "71"])
    assert [(r.done, r.reward) for r in results] == [(False, 0.0), (True, 0.0)]
    assert results[-1].metrics["solved"] == 0.0
    env = ChatEnv(guess_sum.GuessSumEnv(problem(40, 30, "+")), context(tokenizer))
    results = anyio.run(play, tokenizer, env, ["seventy"])
    assert (results[0].done, results[0].reward, results[0].metrics["no_number"]) == (True, 0, 1)


def test_solved_reward_decreases_with_the_guess_and_rejects_bad_turns() -> None:
    rewards = [guess_sum.solved_reward(t, 6) for t in range(1, 7)]
    assert rewards[0] == 1.0 and all(x > y > 0 for x, y in itertools.pairwise(rewards))
    with pytest.raises(ValueError, match=r"turn must be in 1\.\.6"):
        guess_sum.solved_reward(7, 6)


def test_calculator_runs_the_tool_then_scores_the_answer(tokenizer: Any) -> None:
    task = calculator.CalculatorTask()
    builder = task.group_builder(problem(23, 47, "*"), 2, context(tokenizer))

    async def go() -> tuple[list[EnvStepResult], list[EnvStepResult], str]:
        made = await builder.make_envs()
        assert len(made) == 2
        assert isinstance(made[0], ChatEnv)
        first = await made[0].initial_observation()
        assert first.stop.max_tokens == calculator.MAX_REPLY_TOKENS
        envs: list[ChatEnv] = []
        for e in made:
            assert isinstance(e, ChatEnv)
            envs.append(ChatEnv(e.env, e._context, tools=[task.tool]))
        used = await play(tokenizer, envs[0], [calculator.tool_call_text(23, 47), "1081"])
        guessed = await play(tokenizer, envs[1], ["1000"])
        return used, guessed, tokenizer.decode(list(envs[0]._observe().tokens))

    used, guessed, text = anyio.run(go)
    assert [(r.done, r.reward) for r in used] == [(False, 0.0), (True, 1.0)]
    assert used[0].metrics["tool_calls"] == 1.0 and used[0].metrics["tool_errors"] == 0.0
    assert used[-1].metrics == {"solved": 1.0, "used_tool": 1.0}
    assert [(r.done, r.reward) for r in guessed] == [(True, 0.0)]
    assert guessed[0].metrics == {"solved": 0.0, "used_tool": 0.0}
    assert f"Answer: {calculator.tool_call_text(23, 47)}</s>Result: 1081\nAnswer: 1081</s>" in text


def test_slow_tool_waits_and_bad_task_arguments_fail_clearly() -> None:
    assert (
        anyio.run(calculator.multiply_tool(0.01).call, {"a": 6, "b": 7}).messages[0]["content"]
        == "42"
    )
    with pytest.raises(ValueError, match="tool_latency must be >= 0"):
        calculator.CalculatorTask(tool_latency="-1")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        guess_sum.GuessSumTask(max_turns="0")
    with pytest.raises(ValueError, match="max_operand must be an integer"):
        guess_sum.GuessSumTask(max_operand="x")


def test_tasks_are_env_tasks_with_held_out_problems_never_drawn() -> None:
    for task in (guess_sum.GuessSumTask(eval_size="16"), calculator.CalculatorTask()):
        assert is_env_task(task)
        held_out = {p.question for p in task.eval_problems()}
        assert len(held_out) == (16 if task.name == "guess-sum" else 64)
        source = task.source(3)
        assert not any(source.next().question in held_out for _ in range(500))


@pytest.mark.parametrize("kind", ["guess", "calculator", "any tool"])
def test_the_models_training_transcripts_are_what_the_environments_render(
    tokenizer: Any, kind: str
) -> None:
    """The SFT rows of scripts/make_model.py, replayed through the environments (a
    synthetic tool's through a calculator-like environment with that tool): the
    conversation the model was trained on, tool schemas included, is token for token the
    one it will see."""
    rng = random.Random(5)
    for _ in range(20):
        tools: list[Any] = []
        if kind == "guess":
            messages, _ = make_model.guess_transcript(rng)
            a, b = (int(x) for x in messages[0]["content"][8:-1].split(" + "))
            env = ChatEnv(guess_sum.GuessSumEnv(problem(a, b, "+")), context(tokenizer))
        else:
            if kind == "calculator":
                messages, _, tools = make_model.calculator_transcript(rng, 0.5)
            else:
                messages, _, tools = tool_data.tool_transcript(rng, 0.5)
            asked = Problem(0, messages[0]["content"], messages[-1]["content"])
            env = ChatEnv(calculator.CalculatorEnv(asked), context(tokenizer), tools=tools)
        replies = [
            tool_data.call_text(
                m["tool_calls"][0]["function"]["name"], m["tool_calls"][0]["function"]["arguments"]
            )
            if m.get("tool_calls")
            else m["content"]
            for m in messages
            if m["role"] == "assistant"
        ]
        results = anyio.run(play, tokenizer, env, replies)
        assert results[-1].done
        assert kind == "guess" or results[-1].reward == 1.0  # the answer is the tool's result
        ids, _ = make_model.chat_row(tokenizer, messages, set(), tools)
        assert list(env._observe().tokens)[: len(ids)] == ids


def test_replies_stop_at_eos_whatever_the_run_says(tokenizer: Any) -> None:
    async def first_stop(task: Any) -> StopCondition:
        builder = task.group_builder(problem(12, 30, "+"), 1, context(tokenizer))
        envs = await builder.make_envs()
        return (await envs[0].initial_observation()).stop

    guess = anyio.run(first_stop, guess_sum.GuessSumTask())
    calc = anyio.run(first_stop, calculator.CalculatorTask())
    assert tokenizer.eos_token_id in guess.stop_token_ids
    assert guess.max_tokens == guess_sum.MAX_REPLY_TOKENS
    assert tokenizer.eos_token_id in calc.stop_token_ids
    assert calc.max_tokens == calculator.MAX_REPLY_TOKENS
