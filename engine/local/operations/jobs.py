"""Training-operation jobs: what each training endpoint runs on the compute thread.

A job is built on the event loop from the decoded request (cheap checks there, so most
bad input fails at once) and runs on the compute thread (tensor decoding and the backend
call). ``finish`` then runs back on the event loop with the thread's result and returns
the JSON answer; it is where loop-owned bookkeeping happens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import AdamConfig
from engine.local.compute.losses import LOSSES
from engine.local.compute.rollout_correction import RolloutCorrection
from engine.local.compute.rollout_correction import loss as correction_loss
from engine.local.http.wire import (
    ForwardBackwardInputW,
    WireError,
    check_metrics,
    datums_of,
    forward_json,
    token_count,
)
from engine.local.models.storage import TinkerPath, check_name


@dataclass
class Job:
    run: Callable[[], Any]
    """Runs on the compute thread."""
    finish: Callable[[Any], dict[str, Any]]
    """Runs on the event loop with ``run``'s result; returns the future's payload."""
    extra_delay: float = 0.0
    """Simulated latency added after the clock cycle (sampler snapshots)."""
    reads: str | None = None
    """The checkpoint path the job reads (kept from deletion while it runs)."""


@dataclass(frozen=True)
class ModelLimits:
    max_datums: int
    max_tokens: int


def forward_job(
    backend: Backend,
    model_id: str,
    inp: ForwardBackwardInputW,
    limits: ModelLimits,
    *,
    backward: bool,
    server_inputs: list[dict[str, torch.Tensor]] | None = None,
    corrected: RolloutCorrection | None = None,
) -> Job:
    """``server_inputs``: per datum, loss inputs the server supplies (they replace the
    client's of the same name), e.g. ``engine.local.compute.stability.stability_inputs``;
    ``corrected``: the model's rollout correction, which replaces importance_sampling's
    formula (``engine.local.compute.rollout_correction``)."""
    what = "forward_backward" if backward else "forward"
    if not inp.data:
        raise WireError(f"{what} needs at least one datum")
    if len(inp.data) > limits.max_datums:
        raise WireError(
            f"{what} got {len(inp.data)} datums; the local server accepts at most "
            f"{limits.max_datums} per request (its --max-datums)"
        )
    tokens = sum(token_count(datum.model_input) for datum in inp.data)
    if tokens > limits.max_tokens:
        raise WireError(
            f"{what} got {tokens} model_input tokens in {len(inp.data)} datums; the local "
            f"server accepts at most {limits.max_tokens} per request (its "
            "--max-request-tokens): send the datums in smaller requests"
        )
    if inp.loss_fn not in LOSSES:
        raise WireError(f"unsupported loss_fn {inp.loss_fn!r}; supported: {', '.join(LOSSES)}")
    for key, value in (inp.loss_fn_config or {}).items():
        if not math.isfinite(value):
            raise WireError(f"loss_fn_config[{key!r}] must be a finite number")

    def run() -> dict[str, Any]:
        data = datums_of(inp.data)
        for datum, extra in zip(data, server_inputs or (), strict=False):
            datum.inputs.update(extra)
        result = backend.forward_backward(
            model_id,
            data,
            inp.loss_fn,
            inp.loss_fn_config,
            backward=backward,
            formula=None if corrected is None else functools.partial(correction_loss, rc=corrected),
        )
        return forward_json(result)

    return Job(run=run, finish=lambda payload: payload)


def optim_job(
    backend: Backend, model_id: str, adam: AdamConfig, on_applied: Callable[[], None]
) -> Job:
    def run() -> dict[str, float]:
        return backend.optim_step(model_id, adam)

    def finish(metrics: dict[str, float]) -> dict[str, Any]:
        on_applied()
        return {"metrics": check_metrics(metrics, "optim_step") if metrics else {}}

    return Job(run=run, finish=finish)


def save_state_job(
    backend: Backend, model_id: str, name: str | None, data_dir: Path, *, overwrite: bool
) -> Job:
    if name is None:
        raise WireError("save_weights needs a checkpoint name in 'path'")
    target = TinkerPath(model_id, "weights", check_name(name))
    dest = target.directory(data_dir)
    if dest.exists() and not overwrite:
        raise WireError(
            f"checkpoint {target} already exists; save under a new name or pass overwrite=True"
        )

    def run() -> None:
        # The backend writes checkpoints atomically (temp dir + rename).
        backend.save_state(model_id, dest)

    return Job(run=run, finish=lambda _: {"path": str(target), "type": "save_weights"})


def save_sampler_job(
    backend: Backend,
    model_id: str,
    name: str | None,
    data_dir: Path,
    *,
    on_saved: Callable[[str, TinkerPath | None], str | None],
    snapshot_delay: float,
) -> Job:
    """Named: write under sampler_weights/<name> and answer the path. Ephemeral (no
    name): keep the snapshot in memory and answer a new sampling_session_id, which
    ``on_saved(key, path)`` creates."""
    target = TinkerPath(model_id, "sampler_weights", check_name(name)) if name else None

    def run() -> str:
        dest = target.directory(data_dir) if target is not None else None
        return backend.save_sampler(model_id, dest)

    def finish(key: str) -> dict[str, Any]:
        session_id = on_saved(key, target)
        if target is not None:
            return {"path": str(target), "type": "save_weights_for_sampler"}
        return {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}

    return Job(run=run, finish=finish, extra_delay=snapshot_delay)


def load_state_job(
    backend: Backend, model_id: str, path: str, data_dir: Path, *, optimizer: bool
) -> Job:
    source = TinkerPath.parse(path)
    src = source.directory(data_dir)
    if not src.is_dir():
        raise WireError(f"checkpoint {source} not found (looked in {src})")

    def run() -> None:
        backend.load_state(model_id, src, optimizer=optimizer)

    return Job(
        run=run, finish=lambda _: {"path": str(source), "type": "load_weights"}, reads=str(source)
    )
