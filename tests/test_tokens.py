"""Tokens billed per step and over the run, and their estimated cost
(docs/settings.md#tokens-and-cost), on the fake session: its lengths are known, so the
counts are exact integers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
from fake_session import FakeSession
from test_dpo import PairSession, dpo_config, pairs
from test_engine_fake_session import fake_config, run
from test_envs_pipeline import CountdownTask
from test_pipeline_stages import ToyTask, until
from test_sft import ChatSession, conversations, sft_config

from engine.core.datums import Datum
from engine.core.problems import Problem, RewardBreakdown
from engine.loop.results import StepResult
from engine.objectives.rl import RL
from engine.observe.metrics import detail_line
from engine.session.api import (
    CustomLoss,
    LossSpec,
    SampleResult,
    SamplerHandle,
    SamplingParams,
    StepTicket,
)

pytestmark = pytest.mark.anyio

KINDS = ("prefill", "sampled", "trained")


def per_step(steps: Sequence[StepResult], kind: str) -> list[int]:
    return [s.metrics[f"tokens/{kind}"] for s in steps]


def cumulative(steps: Sequence[StepResult], kind: str) -> list[int]:
    return [s.metrics[f"tokens/cumulative/{kind}"] for s in steps]


class Counting:
    """What a fake session was asked, counted by the test's own rule: every call's
    prompt (prefill), returned tokens (sampled) and datum tokens (trained)."""

    counted: dict[str, int]

    async def sample(
        self,
        sampler: SamplerHandle,
        prompt_tokens: Sequence[int],
        num_samples: int,
        settings: SamplingParams,
    ) -> SampleResult:
        result: SampleResult = await super().sample(  # type: ignore[misc]
            sampler, prompt_tokens, num_samples, settings
        )
        self.counted["prefill"] += len(prompt_tokens)
        self.counted["sampled"] += sum(len(c.tokens) for c in result.completions)
        return result

    async def prompt_logprobs(
        self, sampler: SamplerHandle, tokens: Sequence[int]
    ) -> list[float | None]:
        self.counted["prefill"] += len(tokens)
        return await super().prompt_logprobs(sampler, tokens)  # type: ignore[misc,no-any-return]

    async def submit_forward_backward(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: LossSpec
    ) -> None:
        if loss.name != "custom":  # the custom loss's backward, counted below
            self.counted["trained"] += sum(len(d.model_input) for d in datums)
        await super().submit_forward_backward(ticket, datums, loss)  # type: ignore[misc]

    async def submit_forward_backward_custom(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: CustomLoss
    ) -> None:
        tokens = sum(len(d.model_input) for d in datums)
        self.counted["prefill"] += tokens  # the forward pass
        self.counted["trained"] += tokens  # the backward
        await super().submit_forward_backward_custom(ticket, datums, loss)  # type: ignore[misc]


@dataclasses.dataclass
class CountingSession(Counting, FakeSession):
    counted: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))


@dataclasses.dataclass
class CountingChat(Counting, ChatSession):
    counted: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))


@dataclasses.dataclass
class CountingPairs(Counting, PairSession):
    counted: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))


def assert_totals(steps: Sequence[StepResult], counted: dict[str, int]) -> None:
    """Each step's total is the sum of the steps so far, and the run's is everything the
    session was asked."""
    for kind in KINDS:
        sums = [sum(per_step(steps, kind)[: i + 1]) for i in range(len(steps))]
        assert cumulative(steps, kind) == sums, kind
        assert sums[-1] == counted[kind], kind


async def test_each_step_logs_the_tokens_its_calls_billed_and_the_run_total(
    tmp_path: Path,
) -> None:
    """Each step: 2 groups, one request each of prompt "p<i>" (2 tokens) for 2 responses
    "<v> <j>" (3 tokens); 4 datums of prompt + response - 1 = 4 tokens."""
    session = CountingSession()
    steps = await run(fake_config(tmp_path / "run"), ToyTask(), session)
    assert per_step(steps, "prefill") == [4, 4, 4, 4]
    assert per_step(steps, "sampled") == [12, 12, 12, 12]
    assert per_step(steps, "trained") == [16, 16, 16, 16]
    assert cumulative(steps, "trained") == [16, 32, 48, 64]
    assert_totals(steps, session.counted)
    assert not any(k.startswith("cost/") for s in steps for k in s.metrics)  # no price set
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert [last[f"tokens/cumulative/{k}"] for k in KINDS] == [16, 48, 64]
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "- tokens billed: prefill 16, sampled 48, trained 64\n" in summary
    assert "estimated cost" not in summary
    record = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert record["tokens"] == {"prefill": 16, "sampled": 48, "trained": 64, "cost_usd": None}
    assert detail_line(last, RL.step_detail(last)).endswith("| 32 tok (run 128)")


async def test_a_price_adds_the_estimated_cost_of_each_step_and_of_the_run(
    tmp_path: Path,
) -> None:
    cfg = fake_config(tmp_path / "run", price_prefill=0.5, price_sample=2.0, price_train=3.0)
    steps = await run(cfg, ToyTask(), CountingSession())
    step_cost = (4 * 0.5 + 12 * 2.0 + 16 * 3.0) / 1e6
    assert [s.metrics["cost/usd"] for s in steps] == pytest.approx([step_cost] * 4)
    assert steps[-1].metrics["cost/cumulative_usd"] == pytest.approx(4 * step_cost)
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "estimated cost $0.000296 ($0.5/$2/$3 per million prefill/sampled/trained)" in summary
    last = steps[-1].metrics
    assert detail_line(last, RL.step_detail(last)).endswith("$7.4e-05 (run $0.000296)")

    only_train = fake_config(tmp_path / "train", price_train=3.0)  # the others add nothing
    steps = await run(only_train, ToyTask(), CountingSession())
    assert steps[-1].metrics["cost/cumulative_usd"] == pytest.approx(64 * 3.0 / 1e6)


@dataclasses.dataclass
class FlatFirst(ToyTask):
    """Problem 0's responses all score 0: its group has no signal (dynamic sampling
    samples a reserve in its place). Held-out problems "e0", "e1"."""

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        return RewardBreakdown(0.0 if problem.id == 0 else super().score(response, problem).total)

    def eval_problems(self) -> list[Problem]:
        return [Problem(100 + i, f"e{i}", i) for i in range(2)]


async def test_refills_and_held_out_evaluations_are_counted_in_their_step(
    tmp_path: Path,
) -> None:
    """Step 1 samples a reserve (3 groups) and holds the step-0 evaluation (2 greedy
    requests of 2 prompt tokens, 3 sampled each); steps 2 and 4 are evaluated after.
    Step 4 trains problems 9 and 10 ("p10": 3 prompt tokens)."""
    cfg = fake_config(tmp_path / "run", refill_groups=1, eval_every=2)
    session = CountingSession()
    steps = await run(cfg, FlatFirst(), session)
    assert [s.metrics["refill/extra_groups"] for s in steps] == [1, 0, 0, 0]
    assert per_step(steps, "prefill") == [6 + 4, 4 + 4, 4, 5 + 4]
    assert per_step(steps, "sampled") == [18 + 6, 12 + 6, 12, 12 + 6]
    assert per_step(steps, "trained") == [16, 16, 16, 18]  # the flat group trains nothing
    assert_totals(steps, session.counted)


async def test_each_turn_of_an_episode_bills_its_whole_context_as_prefill(
    tmp_path: Path,
) -> None:
    session = CountingSession()
    steps = await run(fake_config(tmp_path / "run", steps=3), CountdownTask(), session)
    for s in steps:
        turns = [turn for g in s.groups for t in g.trajectories for turn in t.turns]
        # A group's first turns are one request for all its episodes; each later turn
        # sends its episode's whole context (the earlier turns too) again.
        first = sum(len(g.trajectories[0].turns[0].observation) for g in s.groups)
        later = [turn for g in s.groups for t in g.trajectories for turn in t.turns[1:]]
        assert s.metrics["tokens/prefill"] == first + sum(len(t.observation) for t in later)
        assert s.metrics["tokens/sampled"] == sum(len(turn.action) for turn in turns)
        assert s.metrics["tokens/trained"] == sum(len(d.model_input) for d in s.datums)
    assert max(len(t.turns) for s in steps for g in s.groups for t in g.trajectories) == 3
    assert_totals(steps, session.counted)


async def test_distillation_counts_the_teachers_logprobs_as_prefill(tmp_path: Path) -> None:
    session = CountingSession()
    cfg = fake_config(tmp_path / "run", objective="distill", teacher="fake-model")
    steps = await run(cfg, ToyTask(), session)
    # 4 responses a step, each scored by the teacher as prompt + response (5 tokens).
    assert per_step(steps, "prefill") == [4 + 4 * 5] * 4
    assert per_step(steps, "sampled") == [12] * 4
    assert_totals(steps, session.counted)


async def test_sft_bills_every_token_of_its_datums_as_trained(tmp_path: Path) -> None:
    session = CountingChat()
    data = conversations(tmp_path / "c.jsonl", 16)
    steps = await run(sft_config(tmp_path / "run", data), None, session)
    for s in steps:
        assert s.metrics["tokens/trained"] == sum(len(d.model_input) for d in s.datums) > 0
        assert s.metrics["tokens/trained"] > s.metrics["sft/tokens"]  # context too
        assert s.metrics["tokens/sampled"] == 0
    assert_totals(steps, session.counted)


async def test_dpo_bills_its_forward_pass_and_the_references_logprobs(tmp_path: Path) -> None:
    session = CountingPairs()
    cfg = dpo_config(tmp_path / "run", pairs(tmp_path / "p.jsonl", 20))
    steps = await run(cfg, None, session)
    for s in steps:
        trained = sum(len(d.model_input) for d in s.datums)
        asked = [turn for g in s.groups for t in g.trajectories for turn in t.turns]
        reference = sum(len(turn.observation) + len(turn.action) for turn in asked)
        assert s.metrics["tokens/trained"] == trained
        assert s.metrics["tokens/prefill"] == trained + reference
    assert_totals(steps, session.counted)


async def test_a_resumed_run_continues_the_total_from_its_checkpoint(tmp_path: Path) -> None:
    session = CountingSession()
    cfg = fake_config(tmp_path / "run", steps=2)
    await run(cfg, ToyTask(), session)
    steps = await run(cfg.replace(steps=4, resume=tmp_path / "run"), ToyTask(), session)
    assert [s.step for s in steps] == [3, 4]
    assert cumulative(steps, "trained") == [48, 64]


async def test_a_lost_step_is_billed_in_its_redo_and_a_rewound_one_in_the_total(
    tmp_path: Path,
) -> None:
    """Step 4 fails with an unknown outcome and the run goes back to step 2's checkpoint:
    what step 4's lost attempt spent is counted in its redo's line, and what the recorded
    (then rewound) step 3 spent stays in the run's total."""
    session = CountingSession(fail_step=4)
    steps = await run(fake_config(tmp_path / "run").replace(checkpoint_every=2), ToyTask(), session)
    assert [s.step for s in steps] == [1, 2, 3, 3, 4]
    assert per_step(steps, "trained") == [16, 16, 16, 16, 32]
    assert steps[-1].metrics["tokens/cumulative/trained"] == session.counted["trained"] == 96
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    kept = [json.loads(line)["tokens/trained"] for line in lines]
    assert sum(kept) == 80  # steps 1-4 as kept: the total also holds the rewound step 3


def test_token_settings_are_refused_in_one_line(tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^price_train must be a number >= 0, got -1.0$"):
        EngineConfig(price_train=-1)


async def test_the_report_draws_the_runs_tokens_and_its_cost_only_when_priced(
    tmp_path: Path,
) -> None:
    from engine.observe.report_panels import build_panels
    from engine.observe.run_data import load_run

    await run(fake_config(tmp_path / "free", steps=2), ToyTask(), CountingSession())
    await run(fake_config(tmp_path / "priced", steps=2, price_train=3.0), ToyTask(), FakeSession())
    free = {p.key: p for p in build_panels([load_run(tmp_path / "free")])}
    priced = {p.key: p for p in build_panels([load_run(tmp_path / "priced")])}
    assert "cost" not in free and "cost" in priced
    tokens = free["tokens"]
    assert [c.what for c in tokens.curves] == list(KINDS)
    assert [list(c.ys) for c in tokens.curves] == [[4, 8], [12, 24], [16, 32]]
    assert list(priced["cost"].curves[0].ys) == pytest.approx([16 * 3e-6, 32 * 3e-6])
    assert (tmp_path / "priced" / "report.png").is_file()
    page = (tmp_path / "priced" / "report.html").read_text()
    assert "<td>prefill 8, sampled 24, trained 32; estimated cost $9.6e-05</td>" in page


async def test_a_stop_keeps_what_the_groups_sampled_ahead_spent_in_events(
    tmp_path: Path,
) -> None:
    """Stopped while step 1 trains, after step 2's groups were sampled ahead (K=1): their
    tokens are in no step's metrics, so events.jsonl keeps them (a resumed run trains
    those groups without sampling them again)."""
    from engine import Engine

    session = CountingSession()
    release = session.hold(1)
    cfg = fake_config(tmp_path / "run", steps=3, submit_ahead=0)
    async with (
        Engine(cfg, task=ToyTask(), session=session) as engine,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(engine.run)
        await until(lambda: session.log.count(("sample", 0)) == 4)  # steps 1 and 2
        engine.request_stop()
        release.set()
    result = engine.result
    assert result is not None and result.stopped and result.steps_completed == 1
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    left = [e for e in events if e["event"] == "tokens.unrecorded"]
    assert [(e["prefill"], e["sampled"], e["trained"]) for e in left] == [(4, 12, 0)]
    assert result.metrics[-1]["tokens/cumulative/prefill"] + 4 == session.counted["prefill"]


async def test_a_judge_on_the_runs_session_is_billed_in_the_step_it_scores(
    tmp_path: Path,
) -> None:
    """Each response ("<v> <j>", 3 tokens) is judged by the run's own sampler: one request
    of the 3-token rubric "{response}" answered with 3 tokens, 4 a step."""
    from engine.tasks.judge import Judge, JudgedTask
    from engine.tasks.judge_task import SessionJudgeModel

    judge = Judge(SessionJudgeModel(None, chat=False), "{response}", cache_size=0)
    session = CountingSession()
    steps = await run(fake_config(tmp_path / "run", steps=2), JudgedTask(ToyTask(), judge), session)
    assert per_step(steps, "prefill") == [4 + 4 * 3] * 2
    assert per_step(steps, "sampled") == [12 + 4 * 3] * 2
    assert steps[-1].metrics["judge/prompt_tokens"] == 24  # the judge's own count, run-wide
    assert_totals(steps, session.counted)
