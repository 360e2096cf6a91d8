"""The local server samples on a thread of its own (the small model's folded copy), as
the hosted samplers run apart from the trainer: a sample does not wait for the compute
thread."""

from __future__ import annotations

import threading

import mint
from mint import types

from engine.local import LocalServer
from engine.local.compute.backend import Backend

KEY = "tml-apart"


def test_a_sample_completes_while_the_compute_thread_is_busy() -> None:
    with LocalServer(api_key=KEY) as server:
        service = mint.ServiceClient(base_url=server.base_url, api_key=KEY)
        sampler = service.create_sampling_client(base_model=server.model_name)
        holding, release = threading.Event(), threading.Event()
        outcome: list[bool] = []

        def hold(_: Backend) -> bool:
            holding.set()
            return release.wait(timeout=300)  # False: sampling waited for this job

        holder = threading.Thread(target=lambda: outcome.append(server.backend_call(hold)))
        holder.start()
        try:
            holding.wait()
            prompt = types.ModelInput.from_ints([1, 40, 41, 42])
            response = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=5, seed=0))
            assert len(response.result().sequences) == 3
        finally:
            release.set()
            holder.join()
        assert outcome == [True]
        jobs = server.stats.compute_jobs
        assert any(label == "asample" for label, _, _ in jobs)
        assert [start for _, start, _ in jobs] == sorted(start for _, start, _ in jobs)
