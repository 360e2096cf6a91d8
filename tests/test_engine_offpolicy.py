"""K >= 1: sampling overlaps training, staleness stays bounded, batches stay exact.

Against the real local server. Overlap is read from the step timelines (perf_counter
instants recorded by the engine), never from wall-clock durations.
"""

from __future__ import annotations

import io
import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.local import LocalServer
from tests.datums import datum_to_dict
from tests.engine_support import run_engine, small_config


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


def _expected_questions(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append(f"What is {a} + {b}?")
    return out


def test_k1_overlaps_sampling_with_training_within_its_bound(
    server: LocalServer, tmp_path: Path
) -> None:
    config = small_config(
        server,
        tmp_path / "run",
        steps=4,
        max_steps_off_policy=1,
        loss="importance_sampling",
    )
    console = io.StringIO()
    steps, result = run_engine(config, console=console)
    text = console.getvalue()
    assert (
        "Warning: --max-steps-off-policy 1 with the unclipped importance_sampling loss: "
        "a clipped loss (--loss ppo) or a truncated one (--tis-cap) is safer off-policy"
    ) in text
    assert [s.line for s in steps] == [x for x in text.splitlines() if x.startswith("Step ")]
    assert [s.step for s in steps] == [1, 2, 3, 4]
    # step k+1 started sampling before step k finished training
    for cur, nxt in itertools.pairwise(steps):
        assert nxt.timeline.sample_start < cur.timeline.train_end
    # never staler than K, and the bound is actually used (step 2 was sampled by v0)
    assert all(0 <= s.staleness <= 1 for s in steps)
    assert steps[1].staleness == 1
    assert steps[1].sampler_versions == (0, 0, 0, 0)
    for s in steps:
        index = s.step - 1
        assert all(index - v <= 1 for v in s.sampler_versions)
        assert s.metrics["sampling_client/step_min"] == min(s.sampler_versions)
        assert s.metrics["off_policy/staleness"] == index - min(s.sampler_versions)
    # each step trains on exactly its own problems, in order: s*batch + i
    questions = _expected_questions(42, 16)
    for s in steps:
        index = s.step - 1
        assert [g.problem.id for g in s.groups] == list(range(index * 4, index * 4 + 4))
        assert [g.problem.question for g in s.groups] == questions[index * 4 : index * 4 + 4]
        assert [g.index for g in s.groups] == [0, 1, 2, 3]
    assert result.steps_completed == 4


def test_k2_never_exceeds_two_steps_of_staleness(server: LocalServer, tmp_path: Path) -> None:
    # --sample-ahead 2: steps 1..3 may all sample before step 1 is submitted (by default
    # a reward task's step waits for the one ahead of it to be submitted).
    config = small_config(
        server,
        tmp_path / "run",
        steps=5,
        max_steps_off_policy=2,
        loss="ppo",
        batch=3,
        sample_ahead=2,
    )
    steps, _ = run_engine(config)
    assert len(steps) == 5
    assert max(s.staleness for s in steps) <= 2
    assert steps[2].staleness == 2  # steps 1..3 were all admitted on version 0
    # LoopState: untrained groups are carried, trained ids are exactly the steps' problems
    for s in steps:
        assert s.state.next_step == s.step
        assert list(s.state.trained_problem_ids) == list(range(s.step * 3))
        assert all(g.step >= s.step for g in s.state.pending_groups)


def _datum_key(d: dict[str, list[int] | list[float]]) -> tuple[tuple[float, ...], ...]:
    return (tuple(d["model_input"]), tuple(d["target_tokens"]), tuple(d["advantages"]))


def test_streaming_minibatches_send_the_same_datums_in_chunks(
    server: LocalServer, tmp_path: Path
) -> None:
    seeds = {"lora_seed": 3, "sampling_seed": 99, "steps": 1}
    whole, _ = run_engine(small_config(server, tmp_path / "whole", **seeds))
    before = server.stats.applied.get("forward_backward", 0)
    streamed, _ = run_engine(
        small_config(server, tmp_path / "streamed", stream_minibatches=1, **seeds)
    )
    calls = server.stats.applied.get("forward_backward", 0) - before
    a = sorted((datum_to_dict(d) for d in whole[0].datums), key=_datum_key)
    b = sorted((datum_to_dict(d) for d in streamed[0].datums), key=_datum_key)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert _datum_key(x) == _datum_key(y)
        assert x["weights"] == y["weights"]
        assert x["advantages"] == pytest.approx(y["advantages"], abs=1e-6)
        assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-3)  # batching noise
    # one forward_backward per group that had datums, one optim_step for the step
    assert calls == streamed[0].metrics["groups/used"] > 1


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo", "dro"])
def test_every_loss_trains_and_reports_kl(loss: str, server: LocalServer, tmp_path: Path) -> None:
    steps, _ = run_engine(small_config(server, tmp_path / "run", steps=1, loss=loss))
    m = steps[0].metrics
    assert m["datums"] > 0
    assert m["optim/loss"] is not None
    assert m["optim/kl_sample_train_v1"] is not None and m["optim/kl_sample_train_v2"] >= 0
    assert m["optim/entropy"] > 0  # minus the mean logprob of what was sampled
    assert m["optim/grad_norm"] is not None and m["optim/grad_norm"] >= 0  # the server's
