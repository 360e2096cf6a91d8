"""One server clock cycle per train step: forward_backward and optim_step are submitted
back to back, so under the local server's hosted-latency clock they can share a cycle.
The quickstart's pattern (await forward_backward, then submit optim_step) cannot: its
optim_step goes out only once forward_backward's cycle has ended, which is what makes
this test able to fail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.quickstart_loop import run_quickstart_loop
from engine.local import LocalServer, OpCycle
from tests.engine_support import API_KEY, quickstart_task_knobs, run_engine, small_config


@pytest.fixture
def server() -> Iterator[LocalServer]:
    with LocalServer(latency="mint:scale=0.05") as s:
        yield s


CYCLE_S = 0.5
"""The clock cycle of the test server (``mint`` scaled by 0.05)."""


def _pairs(ops: list[OpCycle]) -> list[tuple[OpCycle, OpCycle]]:
    """(forward_backward, optim_step) of each step, in order."""
    pairs = []
    last_fb: OpCycle | None = None
    for op in ops:
        if op.endpoint == "forward_backward":
            last_fb = op
        elif op.endpoint == "optim_step":
            assert last_fb is not None
            pairs.append((last_fb, op))
            last_fb = None
    return pairs


def test_engine_train_step_takes_one_cycle_where_the_quickstart_takes_more(
    server: LocalServer, tmp_path: Path
) -> None:
    # The engine sends optim_step right behind forward_backward, without awaiting it: the
    # two arrive well within one cycle (whether a cycle edge falls between them is a
    # matter of timing, so the cycles they land in are not compared).
    config = small_config(server, tmp_path / "run", steps=2, lora_seed=1, submit_ahead=0)
    steps, _ = run_engine(config)
    assert all(s.metrics["datums"] > 0 for s in steps)
    (engine_model,) = server.stats.op_cycles
    engine_pairs = _pairs(server.stats.op_cycles[engine_model])
    assert len(engine_pairs) == 2
    assert all(opt.submitted - fb.submitted < CYCLE_S for fb, opt in engine_pairs)

    run_quickstart_loop(
        base_url=server.base_url,
        api_key=API_KEY,
        base_model=server.model_name,
        rank=8,
        steps=2,
        batch=4,
        group=4,
        lr=3e-3,
        max_tokens=8,
        temperature=1.0,
        **quickstart_task_knobs(server),
        lora_seed=1,
    )
    (ref_model,) = set(server.stats.op_cycles) - {engine_model}
    ref_ops = server.stats.op_cycles[ref_model]
    ref_pairs = _pairs(ref_ops)
    # Its forward_backward's result is released when the cycle after the one it was
    # queued for starts; only then does its optim_step go out, so it is queued for the
    # cycle after that at the earliest: two cycles per train step, whatever the load
    # (a late tick can bring the release closer to the arrival in seconds, so the time
    # between the two submissions is not compared).
    assert ref_pairs and all(opt.cycle >= fb.cycle + 2 for fb, opt in ref_pairs)


def test_a_snapshot_stays_right_behind_its_step_when_the_next_is_submitted_ahead(
    server: LocalServer, tmp_path: Path
) -> None:
    """Version n must hold exactly n optimizer steps: in the model's sequence each
    snapshot follows its own step's optim_step, before the next step's calls."""
    steps, _ = run_engine(small_config(server, tmp_path / "run", steps=3, lora_seed=1))
    assert [s.step for s in steps] == [1, 2, 3]
    (model,) = server.stats.op_cycles
    ops = [op.endpoint for op in server.stats.op_cycles[model] if op.endpoint != "save_weights"]
    # The step-0 checkpoint's sampler weights are version 0: no separate snapshot.
    assert ops[:1] == ["save_weights_for_sampler"]
    assert ops[1:] == [
        "forward_backward",
        "optim_step",
        "save_weights_for_sampler",
        "forward_backward",
        "optim_step",
        "save_weights_for_sampler",
        "forward_backward",
        "optim_step",
        "save_weights_for_sampler",  # the final checkpoint's sampler weights
    ]
