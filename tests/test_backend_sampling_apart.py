"""Sampling apart from training (``Backend.samples_apart``): ``sample`` on a second thread
reads its frozen snapshot, never the weights a concurrent optim_step changes, and leaves
training's own results untouched."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from backend_util import new_backend, prompt_ids, random_datums

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import (
    AdamConfig,
    AdapterSpec,
    DatumIn,
    SampledSequences,
    SampleJob,
)

STEPS = 6


def _train_step(backend: Backend, model_id: str, seed: int) -> float:
    data = [
        DatumIn(t, {"target_tokens": torch.tensor(t[1:] + t[:1]), "weights": torch.ones(len(t))})
        for t in random_datums(backend, 8, seed, min_len=20, max_len=40)
    ]
    result = backend.forward_backward(model_id, data, "cross_entropy", None, backward=True)
    backend.optim_step(model_id, AdamConfig(learning_rate=2e-2))
    return result.metrics["loss:sum"]


def _assert_same(got: list[SampledSequences], want: list[SampledSequences]) -> None:
    for res, ref in zip(got, want, strict=True):
        assert [s.tokens for s in res.sequences] == [s.tokens for s in ref.sequences]
        for s, r in zip(res.sequences, ref.sequences, strict=True):
            assert s.logprobs == pytest.approx(r.logprobs, abs=1e-5)


def test_sampling_on_its_own_thread_reads_the_snapshot_while_training_runs(
    tmp_path: Path,
) -> None:
    backend = new_backend()
    assert backend.samples_apart
    backend.create_model("m", AdapterSpec(rank=4, seed=0))
    _train_step(backend, "m", seed=100)
    key = backend.save_sampler("m", None)
    jobs = [
        SampleJob(key, prompt_ids(backend, 10 + i, 30 + i), 4, 16, temperature=1.0, seed=i)
        for i in range(4)
    ]
    jobs.append(SampleJob(None, prompt_ids(backend, 7, 8), 2, 16, temperature=1.0, seed=9))
    reference = backend.sample(jobs)
    backend.save_state("m", tmp_path / "before")
    serial = [_train_step(backend, "m", seed) for seed in range(STEPS)]
    backend.load_state("m", tmp_path / "before", optimizer=True)

    started = threading.Event()
    stop = threading.Event()
    sampled: list[list[SampledSequences]] = []
    failed: list[BaseException] = []

    def sample_until_stopped() -> None:
        try:
            while not stop.is_set():
                started.set()
                sampled.append(backend.sample(jobs))
        except BaseException as exc:  # reported by the test thread
            failed.append(exc)
            started.set()

    sampler = threading.Thread(target=sample_until_stopped, name="test-sampler")
    sampler.start()
    try:
        started.wait()
        concurrent = []
        for seed in range(STEPS):
            concurrent.append(_train_step(backend, "m", seed))
            if seed == STEPS // 2:  # adapters come and go while sampling runs
                backend.create_model("other", AdapterSpec(rank=2, seed=1))
                _train_step(backend, "other", seed=200)
                backend.delete_model("other")
    finally:
        stop.set()
        sampler.join()
    assert not failed, failed
    assert sampled
    for results in sampled:
        _assert_same(results, reference)
    assert concurrent == pytest.approx(serial, rel=1e-5)

    # the check has teeth: the trained weights sample differently from the snapshot
    moved = backend.sample([replace(jobs[0], sampler=backend.save_sampler("m", None))])
    assert moved[0].sequences[0].logprobs != pytest.approx(
        reference[0].sequences[0].logprobs, abs=1e-3
    )
