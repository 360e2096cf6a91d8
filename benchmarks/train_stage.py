"""The train stage alone, under the hosted-like clock: what one train step costs when
the next step waits for the previous one's results, and when it does not.

    python -m benchmarks.train_stage                # mint profile, 10 steps per mode
    python -m benchmarks.train_stage --quick

Why: with K >= 1 the engine's pipeline is bound by its trainer (see the throughput
timeline). Hosted MinT runs training in clock cycles; a request submitted during a cycle
runs in the next one and its result arrives when that one ends. A trainer that submits
forward_backward + optim_step + the sampler snapshot of a step, then awaits all three
before it submits the next step always misses the cycle that has just begun (the engine
before ``--submit-ahead``; ``--submit-ahead 0`` today). This benchmark measures the step
time of that discipline ("await") against "submit-ahead" (the engine's default): step
s+1 is submitted before step s's results are awaited (at most one step outstanding; the
server runs a model's requests in seq_id order, so the snapshot of step s, reserved
right behind it, holds exactly the weights after step s).

Steps complete in pairs under submit-ahead (two results can land on one cycle edge), so
the figure is the MEAN step time over steps 2..n. Both modes use the same datums
(sampled once from the initial policy) and the same server. In "await" the snapshot is
``save_weights_and_get_sampling_client`` in a worker thread; in "submit-ahead" it must
be reserved in the model's sequence before the next step is submitted, as the engine
does it (``engine.session.mint.reserve_sampler_snapshot`` + ``create_sampling_client_async``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import anyio
import mint
from mint import types

from benchmarks.report import fmt, load_average, markdown_table, run_context, write_json
from benchmarks.runners import TEMPERATURE, Target, Workload, bench_server
from engine.core.datums import group_datums
from engine.core.trajectory import Trajectory, Turn
from engine.session.mint import reserve_sampler_snapshot, to_sdk_datum

__all__ = ["MODES", "main", "measure_trainer"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MODES = ("await", "submit-ahead")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m benchmarks.train_stage",
        description="Train-stage step time: awaiting each step vs submitting the next ahead.",
    )
    p.add_argument("--steps", type=int, default=10, help="train steps per mode (default 10)")
    p.add_argument("--batch", type=int, default=8, help="problems per step (default 8)")
    p.add_argument("--group", type=int, default=6, help="samples per problem (default 6)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per sample (default 16)")
    p.add_argument(
        "--latency", default="mint", metavar="PROFILE", help="server latency (default mint)"
    )
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    p.add_argument("--quick", action="store_true", help="3 steps per mode, scaled-down clock")
    return p


async def _datums(
    target: Target, training: Any, tokenizer: Any, workload: Workload
) -> list[types.Datum]:
    """One step's datums, sampled from the initial policy, built as the engine does."""
    batch, group, max_tokens = workload.batch, workload.group, workload.max_tokens
    task = target.task()
    source = task.source(0)
    sampler = await anyio.to_thread.run_sync(training.save_weights_and_get_sampling_client)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE)
    datums: list[types.Datum] = []
    drawn = 0
    while drawn < batch or not datums:  # a step of constant-reward groups teaches nothing
        if drawn >= 10 * batch:
            raise RuntimeError(f"{drawn} problems sampled and every group had one reward")
        problem = source.next()
        drawn += 1
        prompt = list(tokenizer.encode(task.prompt(problem)))
        response = await sampler.sample_async(
            prompt=types.ModelInput.from_ints(tokens=prompt),
            num_samples=group,
            sampling_params=params,
        )
        episodes = [
            Trajectory(
                (Turn(tuple(prompt), tuple(s.tokens), _logprobs(s), 0, "stop"),),
                group_reward=task.score(tokenizer.decode(list(s.tokens)), problem),
            )
            for s in response.sequences
        ]
        built = group_datums(episodes, on_missing_logprobs="drop")
        datums += [to_sdk_datum(d) for d in built.datums]
    return datums


def _logprobs(sequence: Any) -> tuple[float, ...] | None:
    return None if sequence.logprobs is None else tuple(sequence.logprobs)


async def _await_mode(
    training: Any, datums: list[types.Datum], steps: int, adam: types.AdamParams
) -> list[float]:
    """The engine's trainer today: submit a step, await its results and snapshot, repeat."""
    ends = [time.perf_counter()]
    for _ in range(steps):
        fb = await training.forward_backward_async(datums, "importance_sampling")
        optim = await training.optim_step_async(adam)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, training.save_weights_and_get_sampling_client)
            await fb
            await optim
        ends.append(time.perf_counter())
    return ends


async def _submit_ahead_mode(
    service: Any, training: Any, datums: list[types.Datum], steps: int, adam: types.AdamParams
) -> list[float]:
    """Submit step s+1 before awaiting step s (one step outstanding)."""
    ends = [time.perf_counter()]
    outstanding: tuple[Any, Any, Any] | None = None

    async def finish(futures: tuple[Any, Any, Any]) -> None:
        fb, optim, save = futures
        await fb
        await optim
        path = (await save).path
        await service.create_sampling_client_async(model_path=path)
        ends.append(time.perf_counter())

    for step in range(steps):
        fb = await training.forward_backward_async(datums, "importance_sampling")
        optim = await training.optim_step_async(adam)
        save = reserve_sampler_snapshot(training, f"train-stage-{step}")
        if outstanding is not None:
            await finish(outstanding)
        outstanding = (fb, optim, save)
    assert outstanding is not None
    await finish(outstanding)
    return ends


async def _measure(target: Target, workload: Workload, steps: int, mode: str) -> dict[str, Any]:
    service = await anyio.to_thread.run_sync(
        lambda: mint.ServiceClient(api_key=target.api_key, base_url=target.base_url)
    )
    profile = target.profile
    assert profile.lora_rank is not None and profile.learning_rate is not None
    adam = types.AdamParams(learning_rate=profile.learning_rate)
    try:
        training = await service.create_lora_training_client_async(
            base_model=target.model_name, rank=profile.lora_rank
        )
        tokenizer = await anyio.to_thread.run_sync(training.get_tokenizer)
        datums = await _datums(target, training, tokenizer, workload)
        if mode == "await":
            ends = await _await_mode(training, datums, steps, adam)
        else:
            ends = await _submit_ahead_mode(service, training, datums, steps, adam)
    finally:
        service.holder.close()
    intervals = [b - a for a, b in itertools.pairwise(ends)]
    later = intervals[1:] or intervals  # step 1 includes the first cycle's wait
    return {
        "mode": mode,
        "datums": len(datums),
        "step_times_s": intervals,
        "mean_step_s": sum(later) / len(later),
        "median_step_s": statistics.median(later),
    }


def measure_trainer(target: Target, workload: Workload, *, steps: int, mode: str) -> dict[str, Any]:
    """The trainer alone for ``steps`` steps on one step's worth of ``workload`` datums:
    ``mode`` "await" (each step awaited before the next) or "submit-ahead" (the
    engine's discipline). Returns the datum count, every step time and the mean/median
    over steps 2..n."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return anyio.run(_measure, target, workload, steps, mode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.latency = 3, "mint:scale=0.01"
    for name in ("steps", "batch", "group", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from engine.local import LatencyProfile

    try:
        profile = LatencyProfile.parse(args.latency)
    except ValueError as exc:
        parser.error(str(exc))
    context = run_context(vars(args))
    workload = Workload(args.batch, args.group, args.max_tokens)
    with bench_server(args.latency) as target:
        results = {
            mode: measure_trainer(target, workload, steps=args.steps, mode=mode) for mode in MODES
        }
    context["load_average_end"] = load_average()
    cycle = profile.cycle if profile is not None else None
    rows = [
        [
            mode,
            str(r["datums"]),
            fmt(r["mean_step_s"], ".3f"),
            fmt(r["mean_step_s"] / cycle if cycle else None, ".2f"),
        ]
        for mode, r in results.items()
    ]
    headers = ("trainer", "datums/step", "mean step s (steps 2..n)", "clock cycles/step")
    text = markdown_table(headers, rows)
    write_json(
        args.out / "train_stage.json",
        {"context": context, "cycle_s": cycle, "modes": results},
    )
    (args.out / "train_stage.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
