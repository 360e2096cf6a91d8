"""Client and server CPU for bursts of concurrent samples through the `mint` SDK.

    python -m benchmarks.sample_bursts                    # the engine's client, then the SDK's
    python -m benchmarks.sample_bursts --clients engine --bursts 40

A step of the engine at 32x8x16 sends 32 asample requests at once; what the client and
the server spend on each burst (HTTP, connections, the SDK's futures) is CPU taken from
the two-core machine's sampling window. Each client (``engine``: the session's loopback
HTTP client, ``engine.session.mint.service_client``; ``sdk``: a plain
``mint.ServiceClient``) gets a fresh standalone local server; after one warm-up burst,
``--bursts`` bursts of ``--concurrency`` requests (``--samples`` each, 4 tokens) are
timed: this process's CPU, the server process's CPU, and the wall time. Run it on a
quiet machine, and alternate the clients (``--rounds``), as the figures move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from collections.abc import Callable

import mint
import tinker
from tinker import types

from benchmarks.measure import pid_cpu_seconds, positive_int, process_cpu_seconds
from engine.basemodels.catalogue import DEFAULT_MODEL_DIR
from engine.basemodels.recommended import served_model_name
from engine.local.launch import spawn_local_server
from engine.session.mint import service_client

CLIENTS: dict[str, Callable[[str, str], tinker.ServiceClient]] = {
    "engine": service_client,
    "sdk": lambda base_url, key: mint.ServiceClient(base_url=base_url, api_key=key),
}


def measure(client: str, bursts: int, concurrency: int, samples: int) -> str:
    key = "tml-sample-bursts"
    with (
        tempfile.TemporaryDirectory() as data_dir,
        spawn_local_server(data_dir=data_dir, api_key=key, stderr=subprocess.DEVNULL) as server,
    ):
        service = CLIENTS[client](server.base_url, key)
        try:
            training = service.create_lora_training_client(
                base_model=served_model_name(DEFAULT_MODEL_DIR), rank=8
            )
            sampler = training.save_weights_and_get_sampling_client()
            prompt = types.ModelInput.from_ints([1, 40, 41, 42, 43])
            params = types.SamplingParams(max_tokens=4)

            async def burst() -> None:
                requests = (
                    sampler.sample_async(prompt, samples, params) for _ in range(concurrency)
                )
                await asyncio.gather(*requests)

            def run(n: int) -> None:
                for _ in range(n):
                    service.holder.run_coroutine_threadsafe(burst()).result()

            run(1)
            pid = server.process.pid
            client_0, server_0 = process_cpu_seconds(), pid_cpu_seconds(pid) or 0.0
            wall_0 = time.perf_counter()
            run(bursts)
            client_s = process_cpu_seconds() - client_0
            server_s = (pid_cpu_seconds(pid) or 0.0) - server_0
            wall_s = time.perf_counter() - wall_0
        finally:
            service.holder.close()
    return (
        f"{client:6s} {bursts} bursts of {concurrency}: client CPU {client_s:.2f} s, "
        f"server CPU {server_s:.2f} s, wall {wall_s:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=["engine", "sdk"])
    parser.add_argument("--bursts", type=positive_int, default=20)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument("--samples", type=positive_int, default=8)
    parser.add_argument(
        "--rounds", type=positive_int, default=1, help="times to run the clients in turn"
    )
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    for _ in range(args.rounds):
        for client in args.clients:
            print(measure(client, args.bursts, args.concurrency, args.samples), flush=True)


if __name__ == "__main__":
    main()
