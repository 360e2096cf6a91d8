"""One server clock cycle per train step: forward_backward and optim_step are submitted
back to back, so under the local server's hosted-latency clock they land in the same
cycle. The quickstart's pattern (await forward_backward, then submit optim_step) lands
them in different cycles, which is what makes this test able to fail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.quickstart_loop import run_quickstart_loop
from engine.local import LocalServer, OpCycle
from tests.engine_support import API_KEY, quickstart_task_knobs, run_engine, small_config


@pytest.fixture
def server() -> Iterator[LocalServer]:
    with LocalServer(latency="mint:scale=0.02") as s:
        yield s


def _pairs(ops: list[OpCycle]) -> list[tuple[int, int]]:
    """(forward_backward cycle, optim_step cycle) of each step, in order."""
    pairs = []
    last_fb: int | None = None
    for op in ops:
        if op.endpoint == "forward_backward":
            last_fb = op.cycle
        elif op.endpoint == "optim_step":
            assert last_fb is not None
            pairs.append((last_fb, op.cycle))
            last_fb = None
    return pairs


def test_engine_train_step_takes_one_cycle_where_the_quickstart_takes_more(
    server: LocalServer, tmp_path: Path
) -> None:
    # Each step submitted after the previous one's results: a step's two calls follow a
    # cycle edge, far from the next one. (Submitted ahead, a step can be submitted at any
    # point of a cycle, so its two calls may straddle an edge: a matter of timing.)
    config = small_config(server, tmp_path / "run", steps=2, lora_seed=1, submit_ahead=0)
    steps, _ = run_engine(config)
    assert all(s.metrics["datums"] > 0 for s in steps)
    (engine_model,) = server.stats.op_cycles
    engine_ops = server.stats.op_cycles[engine_model]
    engine_pairs = _pairs(engine_ops)
    assert len(engine_pairs) == 2
    assert all(fb == opt for fb, opt in engine_pairs)

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
    assert ref_pairs and all(opt > fb for fb, opt in ref_pairs)


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
