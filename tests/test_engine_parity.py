"""K=0 is the MinT quickstart's algorithm, datum for datum, against the real local server.

The reference (benchmarks/quickstart_loop.py) runs the quickstart loop with the SDK's
sync calls, one request at a time; the engine samples concurrently and submits
forward_backward + optim_step back to back. With the same problem seed, LoRA seed and
sampling seed both must draw the same problems, sample the same responses, skip the same
ones and send the same datums in the same order, and print the same per-step lines.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.quickstart_loop import run_quickstart_loop
from engine.local import LocalServer
from tests.datums import datum_to_dict
from tests.engine_support import API_KEY, quickstart_task_knobs, run_engine, small_config


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


def test_k0_sends_the_quickstart_datums(server: LocalServer, tmp_path: Path) -> None:
    knobs = {
        "rank": 8,
        "steps": 3,
        "batch": 4,
        "group": 4,
        "lr": 3e-3,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 42,
        **quickstart_task_knobs(server),
        "lora_seed": 7,
        "sampling_seed": 1234,
    }
    ref = run_quickstart_loop(
        base_url=server.base_url, api_key=API_KEY, base_model=server.model_name, **knobs
    )
    config = small_config(
        server,
        tmp_path / "run",
        lora_rank=8,
        steps=3,
        seed=42,
        lora_seed=7,
        sampling_seed=1234,
        max_steps_off_policy=0,
        loss="importance_sampling",
    )
    steps, result = run_engine(config)

    assert len(steps) == len(ref.datums) == 3
    assert sum(len(d) for d in ref.datums) > 0, "the reference trained on nothing"
    for step, ref_datums, ref_questions, ref_line in zip(
        steps, ref.datums, ref.questions, ref.lines, strict=True
    ):
        assert [g.problem.question for g in step.groups] == ref_questions
        assert step.line == ref_line
        assert len(step.datums) == len(ref_datums)
        for ours, theirs in zip(step.datums, ref_datums, strict=True):
            a, b = datum_to_dict(ours), datum_to_dict(theirs)
            assert a["model_input"] == b["model_input"]
            assert a["target_tokens"] == b["target_tokens"]
            assert a["weights"] == b["weights"]
            assert a["advantages"] == pytest.approx(b["advantages"], abs=1e-6)
            # batched vs one-at-a-time sampling: same tokens, logprobs up to float noise
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-3)
        assert step.staleness == 0
        assert step.sampler_versions == (step.step - 1,) * 4
    assert result.final_path is not None and result.final_path.startswith("tinker://")
    assert result.steps_completed == 3


def test_k0_problems_match_the_quickstart_without_any_seeds(
    server: LocalServer, tmp_path: Path
) -> None:
    """Without the test-only seeds sampling differs run to run, but the problems, the
    prompts and the datum layout rules must still be the quickstart's."""
    config = small_config(server, tmp_path / "run", steps=2, op="*", max_operand=199)
    steps, _ = run_engine(config)
    rng = random.Random(42)
    for step in steps:
        for group in step.groups:
            a, b = rng.randint(10, 199), rng.randint(10, 199)
            assert group.problem.question == f"What is {a} * {b}?"
            assert group.problem.answer == a * b
        for datum in step.datums:
            d = datum_to_dict(datum)
            n = sum(1 for w in d["weights"] if w == 1.0)
            assert d["weights"] == [0.0] * (len(d["weights"]) - n) + [1.0] * n
            assert d["model_input"][1:] == d["target_tokens"][:-1]
            assert all(x == 0.0 for x in d["logprobs"][: len(d["weights"]) - n])
            assert all(x <= 0.0 for x in d["logprobs"][-n:])
