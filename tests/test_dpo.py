"""Preference pairs (``--objective dpo``) below the session seam: the loss against a hand
computation, the prompt tokens masked, the refusals, reference logprobs asked once per
pair, steps exactly once through the custom-loss call, resume training the same next
step, the held-out evaluation. On the fake session (tests/fake_session.py); the real run
is in tests/test_engine_dpo.py."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_session import FakeSession
from test_pipeline_stages import config
from test_sft import ChatByteTokenizer

from engine import Engine, EngineConfig
from engine.catalog import load_task
from engine.core.datums import supervised_datums
from engine.errors import ConfigError
from engine.loop.dpo import DpoLoss, PairPlan
from engine.loop.results import StepResult
from engine.objectives import checked_objective
from engine.run import main
from engine.tasks.pairs import PairTask
from engine.tasks.render import PromptRenderer

pytestmark = pytest.mark.anyio

BETA = 0.5


@dataclasses.dataclass
class PairSession(FakeSession):
    @property
    def tokenizer(self) -> ChatByteTokenizer:  # type: ignore[override]
        return ChatByteTokenizer()


def pairs(path: Path, count: int, **extra: Any) -> Path:
    with path.open("w") as f:
        for i in range(count):
            row = {"prompt": f"say {i}", "chosen": f"{i}", "rejected": f"no{i}", **extra}
            f.write(json.dumps(row) + "\n")
    return path


def dpo_config(run_dir: Path, data: Path, **changes: Any) -> EngineConfig:
    return config(
        task=f"jsonl:{data}",
        objective="dpo",
        dpo_beta=BETA,
        run_dir=run_dir,
        checkpoint_every=1,
        progress=False,
        **changes,
    )


async def run(
    cfg: EngineConfig, session: FakeSession, console: io.StringIO | None = None
) -> list[StepResult]:
    steps: list[StepResult] = []
    async with Engine(cfg, session=session, on_step=steps.append, console=console) as engine:
        await engine.run()
    return steps


def test_the_dpo_loss_and_its_gradient_match_a_hand_computation() -> None:
    # Two pairs; datums chosen, rejected, chosen, rejected; the first token is a prompt token.
    weights = tuple(np.array(w, dtype=np.float64) for w in ([0, 1, 1], [0, 1], [0, 1], [0, 1, 1]))
    logprobs = [np.array(lp) for lp in ([-9.0, -1.0, -2.0], [-9.0, -2.5], [-9, -0.5], [-9, -1, -1])]
    reference = (-3.5, -2.0, -1.0, -1.5)
    loss = DpoLoss(weights, reference, BETA, scale=0.5)(logprobs)
    # pair 1: policy chosen -3, rejected -2.5; margin = 0.5 * ((-3 + 3.5) - (-2.5 + 2)) = 0.5
    # pair 2: policy chosen -0.5, rejected -2; margin = 0.5 * ((-0.5 + 1) - (-2 + 1.5)) = 0.5
    m = 0.5
    assert loss.loss == pytest.approx(0.5 * 2 * math.log(1 + math.exp(-m)), rel=1e-9)
    coefficient = -0.5 * BETA / (1 + math.exp(m))  # d loss / d policy sum of a chosen response
    expected = [coefficient * w if k % 2 == 0 else -coefficient * w for k, w in enumerate(weights)]
    for got, want in zip(loss.gradients, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-9)
        assert got[0] == 0.0  # the prompt token gets no gradient
    assert loss.metrics["dpo/accuracy"] == 1.0
    assert loss.metrics["dpo/margin"] == pytest.approx(0.5)
    assert loss.metrics["dpo/chosen_reward"] == pytest.approx(0.5 * (0.5 + 0.5) / 2)


def test_the_dpo_gradient_is_the_derivative_of_its_loss() -> None:
    rng = np.random.default_rng(0)
    weights = tuple(np.array([0.0, 1.0, 1.0, 1.0]) for _ in range(4))
    reference = tuple(float(x) for x in rng.normal(-3, 1, 4))
    logprobs = [rng.normal(-1, 0.5, 4) for _ in range(4)]
    dpo = DpoLoss(weights, reference, 2.0, scale=0.25)
    value = dpo(logprobs)
    eps = 1e-6
    for d in range(4):
        for t in range(4):
            moved = [lp.copy() for lp in logprobs]
            moved[d][t] += eps
            numeric = (dpo(moved).loss - value.loss) / eps
            assert value.gradients[d][t] == pytest.approx(numeric, abs=1e-5)


def test_only_the_response_tokens_of_a_pair_are_weighted(tmp_path: Path) -> None:
    task = PairTask(pairs(tmp_path / "p.jsonl", 1))
    plan = PairPlan(task, PromptRenderer(task, ChatByteTokenizer()), None)
    problem = task.source(0).next()
    assert problem is not None
    chosen, rejected = plan.group(problem, 0)
    for trajectory, text in ((chosen, "0|"), (rejected, "no0|")):
        [datum] = supervised_datums(trajectory)
        targets = bytes(datum.loss_fn_inputs["target_tokens"].tolist()).decode()
        weights = datum.loss_fn_inputs["weights"]
        assert targets.endswith(text) and targets.startswith("user>say 0|<assistant>")
        assert "".join(c for c, w in zip(targets, weights, strict=True) if w == 1.0) == text


@pytest.mark.parametrize(
    ("row", "error"),
    [
        ({"prompt": "p", "chosen": "a"}, r"p\.jsonl:2: the pair has no rejected response"),
        ({"prompt": "p", "chosen": " ", "rejected": "b"}, r":2: the pair has no chosen response"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, r":2: chosen and rejected are the same"),
        ({"chosen": "a", "rejected": "b"}, r":2 has no prompt field 'prompt'"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, r":2: the prompt must be a non-empty"),
    ],
)
def test_a_bad_pair_is_refused_naming_its_line(
    tmp_path: Path, row: dict[str, str], error: str
) -> None:
    data = pairs(tmp_path / "p.jsonl", 1)
    with data.open("a") as f:
        f.write(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=error):
        load_task(f"jsonl:{data}", objective="dpo")


def test_a_bad_pair_file_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = pairs(tmp_path / "p.jsonl", 2, rejected="same", chosen="same")
    run_dir = tmp_path / "run"
    code = main(["--objective", "dpo", "--task", f"jsonl:{data}", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "chosen and rejected are the same response" in err[0]


def test_a_pair_longer_than_the_context_is_refused_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    task = PairTask(pairs(tmp_path / "p.jsonl", 3, chosen="x" * 50))
    with pytest.raises(ConfigError, match=r"pair 1 of dpo-p is 7\d tokens long .* context of 40"):
        PairPlan(task, PromptRenderer(task, ChatByteTokenizer()), 40)


def test_dpo_refuses_a_task_without_pairs_and_streamed_minibatches(tmp_path: Path) -> None:
    from engine.engine import prepare_run

    with pytest.raises(ConfigError, match="--objective dpo trains on preference pairs"):
        prepare_run(config(objective="dpo", run_dir=tmp_path / "run"), None)
    with pytest.raises(ConfigError, match="--stream-minibatches splits"):
        checked_objective(config(objective="dpo", stream_minibatches=1))


def test_a_dpo_setting_is_refused_where_no_stage_trains_dpo() -> None:
    with pytest.raises(
        ConfigError, match="--dpo-beta is a setting of --objective dpo, and this run trains rl"
    ):
        checked_objective(EngineConfig(dpo_beta=0.5))
    assert checked_objective(EngineConfig(objective="dpo", dpo_beta=0.5)).name == "dpo"
    assert checked_objective(EngineConfig(objective="sft", then="dpo", dpo_beta=0.5)).name == "sft"
    assert (
        checked_objective(EngineConfig(dpo_beta=0.1)).name == "rl"
    )  # its default: nothing ignored


async def test_a_session_without_a_custom_loss_refuses_dpo_in_one_line(tmp_path: Path) -> None:
    session = PairSession(custom_loss_refusal="torch is not installed in this environment")
    cfg = dpo_config(tmp_path / "run", pairs(tmp_path / "p.jsonl", 8))
    with pytest.raises(ConfigError, match="--objective dpo cannot run: torch is not installed"):
        await run(cfg, session)
    assert [e for e in session.log if e[0] in ("forward", "forward_backward")] == []


async def test_dpo_trains_each_step_once_through_the_custom_loss(tmp_path: Path) -> None:
    session = PairSession()
    cfg = dpo_config(tmp_path / "run", pairs(tmp_path / "p.jsonl", 20))
    console = io.StringIO()
    steps = await run(cfg, session, console)
    assert [s.step for s in steps] == [1, 2, 3, 4]
    # Each step's second console line is the objective's (dpo's: the implicit rewards).
    assert console.getvalue().count("\n  chosen_reward=+") == 4
    assert [e for e in session.log if e[0] in ("sample", "snapshot")] == []
    assert [step for step, _, _ in session.custom_losses] == [1, 2, 3, 4]
    assert {loss.name for loss in session.losses} == {"custom"}
    # The reference (the base sampler) was asked once per response of the 8 pairs.
    assert session.log.count(("prompt_logprobs", 0)) == 16
    for s in steps:
        rows = [g.problem.data["row"] for g in s.groups]
        # The fake trains at logprob -0.5 per token, the reference scored -1 per token.
        chosen = [BETA * 0.5 * len(f"{r}|") for r in rows]
        rejected = [BETA * 0.5 * len(f"no{r}|") for r in rows]
        assert s.metrics["dpo/chosen_reward"] == pytest.approx(np.mean(chosen))
        assert s.metrics["dpo/rejected_reward"] == pytest.approx(np.mean(rejected))
        assert s.metrics["dpo/accuracy"] == 0.0  # the rejected responses are longer here
        assert s.metrics["dpo/pairs"] == 2
        assert s.line.startswith(f"Step {s.step}: dpo/loss=")


async def test_each_pair_is_scored_by_the_reference_once_across_epochs(tmp_path: Path) -> None:
    session = PairSession()
    data = pairs(tmp_path / "p.jsonl", 3)
    cfg = dpo_config(tmp_path / "run", data, steps=10, task_args={"epochs": "2"})
    steps = await run(cfg, session)
    assert len(steps) == 3  # 6 pairs, batch 2
    assert session.log.count(("prompt_logprobs", 0)) == 6  # 3 pairs, 2 responses each


async def test_a_resumed_dpo_run_trains_the_same_next_steps(tmp_path: Path) -> None:
    data = pairs(tmp_path / "p.jsonl", 20)
    whole_session = PairSession()
    await run(dpo_config(tmp_path / "whole", data, steps=6), whole_session)
    session = PairSession()
    cfg = dpo_config(tmp_path / "run", data, steps=6)
    async with Engine(cfg, session=session) as engine:

        async def stop_after_two(result: StepResult) -> None:
            if result.step == 2:
                engine.request_stop()

        engine.add_step_hook(stop_after_two)
        assert (await engine.run()).stopped
    await run(cfg.replace(resume=tmp_path / "run"), session)
    whole = {step: (datums, value) for step, datums, value in whole_session.custom_losses}
    resumed = {step: (datums, value) for step, datums, value in session.custom_losses}
    assert sorted(resumed) == sorted(whole) == [1, 2, 3, 4, 5, 6]
    for step in range(3, 7):
        (datums, value), (want_datums, want) = resumed[step], whole[step]
        assert [d.model_input.tolist() for d in datums] == [
            d.model_input.tolist() for d in want_datums
        ]
        assert value.loss == pytest.approx(want.loss, rel=1e-9)
        for got, expected in zip(value.gradients, want.gradients, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-9)


async def test_held_out_pairs_are_evaluated_at_the_start_and_every_n_steps(
    tmp_path: Path,
) -> None:
    data = pairs(tmp_path / "p.jsonl", 20)
    cfg = dpo_config(tmp_path / "run", data, eval_every=2, task_args={"eval_size": "4"})
    session = PairSession()
    steps = await run(cfg, session)
    records = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").open()]
    assert [r["step"] for r in records] == [0, 2, 4]
    assert records[0]["eval/dpo/margin"] == 0.0  # step 0: the policy is the reference
    # The fake's later snapshots score every token higher: the shorter chosen responses
    # gain less, so the margin falls below 0 and the accuracy stays 0.
    assert records[-1]["eval/dpo/margin"] < 0 and records[-1]["eval/dpo/accuracy"] == 0.0
    assert all(r["eval/dpo/pairs"] == 4 for r in records)
    assert {"eval/dpo/loss", "eval/dpo/prefers_chosen"} <= set(records[0])
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "- held-out (scored), step 0 -> 4: dpo/accuracy" in summary
    assert "greedy" not in summary
    assert "eval/dpo/accuracy" in steps[1].metrics and "eval/dpo/accuracy" not in steps[0].metrics
    held_out = {p.data["row"] for p in PairTask(data, eval_size=4).eval_problems()}
    assert not held_out & {g.problem.data["row"] for s in steps for g in s.groups}
    # 16 training and 4 held-out pairs: the reference scored each response of each once.
    assert session.log.count(("prompt_logprobs", 0)) == 2 * (8 + 4) + 2 * 4
