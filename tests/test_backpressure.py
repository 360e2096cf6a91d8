"""The engine under a busy hosted server's sampling queue (#41 item 3): a run through the
unmodified SDK against the local server's ``mint`` profile with one sampling slot
finishes every step, sees the queue's 408s in its metrics and console line, and spends
no retry on them (docs/reliability.md, "A busy hosted server: the sampling queue")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.local import LocalServer
from engine.local.config import ServerConfig
from engine.objectives.rl import RL
from engine.observe.metrics import detail_line
from engine.session import mint as mint_session
from engine.session.queue_watch import QueueObserver, follow_queue_states
from tests.engine_support import API_KEY, run_engine, small_config

QUEUED = {
    "Retry-After": "2",
    "X-Queue-Depth": "7",
    "X-Queue-Position": "5",
    "X-Queue-ETA-S": "2.500",
    "X-Queue-Status": "queued",
}


def response(status: int, headers: dict[str, str]) -> httpx.Response:
    return httpx.Response(status, headers=headers)


def test_the_observer_counts_queue_answers_only_and_resets_on_take() -> None:
    queue = QueueObserver()
    queue.observe(response(408, QUEUED))
    queue.observe(response(408, {**QUEUED, "X-Queue-Position": "2", "X-Queue-ETA-S": "9"}))
    queue.observe(response(408, {}))  # a proxy's timeout: not the queue's
    queue.observe(response(200, QUEUED))
    queue.observe(response(408, {"X-Queue-Status": "queued", "X-Queue-Position": "bad"}))
    assert queue.take() == {
        "queue/waits": 3,
        "queue/position_max": 5,
        "queue/depth_max": 7,
        "queue/eta_s_max": 9.0,
    }
    assert queue.take() == {
        "queue/waits": 0,
        "queue/position_max": None,
        "queue/depth_max": None,
        "queue/eta_s_max": None,
    }


class SdkSamplingClient:
    """What the SDK's sampling client offers here: the method its futures call."""

    def __init__(self) -> None:
        self.reported: list[tuple[Any, str | None]] = []

    def on_queue_state_change(self, state: Any, reason: str | None) -> None:
        self.reported.append((state, reason))


def test_queue_states_the_sdk_reports_count_as_waits_without_place() -> None:
    from tinker.lib.api_future_impl import QueueState

    queue, client = QueueObserver(), SdkSamplingClient()
    follow_queue_states(client, queue)
    client.on_queue_state_change(QueueState.PAUSED_CAPACITY, "waiting for a slot")
    client.on_queue_state_change(QueueState.PAUSED_RATE_LIMIT, None)
    client.on_queue_state_change(QueueState.ACTIVE, None)  # no longer waiting
    assert len(client.reported) == 3  # the SDK's own method still runs (it logs the wait)
    assert queue.take() == {
        "queue/waits": 2,
        "queue/position_max": None,
        "queue/depth_max": None,
        "queue/eta_s_max": None,
    }
    assert type(client).on_queue_state_change is SdkSamplingClient.on_queue_state_change


def saturated_server() -> LocalServer:
    return LocalServer(
        config=ServerConfig(
            service="mint",
            sampling_slots=1,
            latency="sample_request_s=1.2,sample_token_s=0",
            api_key=API_KEY,
        )
    )


def test_a_saturated_queue_costs_no_failed_request_and_shows_in_the_metrics(
    tmp_path: Path,
) -> None:
    """One sampling slot, a sample taking longer than the server holds a poll of a
    waiting request (1 s), a batch of groups sampled at once: most requests wait and
    their polls get 408s. One retry attempt and a breaker
    that opens at the first failure: a 408 taken for a failure would end the run."""
    with saturated_server() as server:
        config = small_config(
            server,
            tmp_path / "run",
            steps=3,
            batch=4,
            group=2,
            max_steps_off_policy=1,
            retry_attempts=1,
            max_consecutive_failures=1,
        )
        steps, result = run_engine(config)
        told_to_wait = server.stats.sampling_queue["told_to_wait"]
    assert [s.step for s in steps] == [1, 2, 3]
    assert told_to_wait >= 1
    metrics = [s.metrics for s in steps]
    assert sum(m["queue/waits"] for m in metrics) >= 1
    assert all(m["off_policy/staleness"] <= 1 for m in metrics)  # the K bound held
    assert all(m["groups/total"] == 4 for m in metrics)  # no group lost
    assert result.steps_completed == 3 and not result.stopped
    retries = [v for m in metrics for k, v in m.items() if k.startswith("retries/")]
    assert retries and not any(retries)
    waited = next(m for m in metrics if m["queue/waits"])
    assert waited["queue/position_max"] >= 1
    assert f"queued {waited['queue/waits']}x pos<=" in detail_line(waited, RL.step_detail(waited))
    recorded = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"event": "step"' in line
    ]
    assert [r["queue/waits"] for r in recorded] == [m["queue/waits"] for m in metrics]
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"retry"' not in events and "breaker" not in events


@pytest.mark.slow
def test_without_a_hook_on_the_http_client_the_queue_still_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As against a remote server: the SDK builds its own HTTP clients (no response
    hook), and the waits it reports to its sampling clients are what the metrics count."""
    monkeypatch.setattr(mint_session, "hooks_http_client", lambda _url: False)
    with saturated_server() as server:
        config = small_config(server, tmp_path / "run", steps=2, batch=4, group=2, retry_attempts=1)
        steps, result = run_engine(config)
        told_to_wait = server.stats.sampling_queue["told_to_wait"]
    assert result.steps_completed == 2 and told_to_wait >= 1
    metrics = [s.metrics for s in steps]
    assert sum(m["queue/waits"] for m in metrics) >= 1
    assert all(m["queue/position_max"] is None for m in metrics)  # no headers read
