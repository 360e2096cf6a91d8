"""Embedding the engine in an asyncio service.

A tiny service with a status endpoint (plain asyncio streams on loopback) that runs an
RL job in the background of the same event loop. The job publishes each step through an
``on_step`` hook; the status endpoint answers with the latest step as JSON while the job
runs; ``--cancel-after N`` cancels the job after N steps, the way a service would on a
client's request, and the service carries on. No signal handlers, no global state.

    python examples/embed_service.py                      # local server, 3 steps
    python examples/embed_service.py --steps 5 --cancel-after 2

Then, while it runs: ``curl http://127.0.0.1:<port>/`` (the port is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from engine import Engine, EngineConfig, StepResult


class TrainingService:
    """Owns one training job and reports its progress."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {"state": "idle"}
        self._stop: tuple[int, asyncio.Task[None]] | None = None

    def stop_after(self, step: int, job: asyncio.Task[None]) -> None:
        self._stop = (step, job)

    def on_step(self, step: StepResult) -> None:
        self.status = {
            "state": "training",
            "step": step.step,
            "avg_reward": round(step.metrics["avg_reward"], 4),
            "staleness": step.staleness,
        }
        print(f"[service] {step.line}", flush=True)
        if self._stop is not None and step.step >= self._stop[0]:
            self._stop[1].cancel()

    async def train(self, config: EngineConfig) -> None:
        async with Engine(config, on_step=self.on_step) as engine:
            result = await engine.run()
        self.status = {"state": "done", "saved": result.final_path, "run_dir": str(result.run_dir)}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()  # the request line; headers are ignored
        body = json.dumps(self.status).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()


async def main(steps: int, cancel_after: int | None) -> None:
    service = TrainingService()
    server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(f"[service] status at http://127.0.0.1:{port}/", flush=True)
    config = EngineConfig(local=True, steps=steps, batch=4, group=4, max_tokens=8)
    async with server:
        job = asyncio.create_task(service.train(config))
        if cancel_after is not None:
            # A client asking to stop the job: cancel the task that runs the engine.
            service.stop_after(cancel_after, job)
        try:
            await job
        except asyncio.CancelledError:
            service.status = {"state": "cancelled", "after_step": service.status.get("step")}
        print(f"[service] final status: {json.dumps(service.status)}", flush=True)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        print(f"[service] tasks left besides the service: {len(others)}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cancel-after", type=int, default=None)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.cancel_after))
