"""``--log-to``: the W&B (offline) and TensorBoard sinks get every step's metrics under
the names of metrics.jsonl; a bad or failing tracker is one clear line."""

from __future__ import annotations

import io
import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig, config_from_sources, stored_settings
from engine.errors import ConfigError
from engine.local import LocalServer
from engine.objectives.rl import RL
from engine.observe.metrics import RunLog
from engine.observe.run_report import REPORT_PNG
from engine.observe.trackers import TensorBoardSink, WandbSink, scalar_metrics
from tests.engine_support import API_KEY, run_engine, small_config


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The ``history`` records (one per logged step) of the offline W&B run in
    ``run_dir``, once the run's ``exit`` record is written (W&B's service process may
    still be flushing when ``finish()`` returns)."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while True:
        records = _wandb_records(path.read_bytes())
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            break
        assert time.monotonic() < deadline, f"{path} has no exit record"
        time.sleep(0.2)
    return [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]


def _wandb_records(data: bytes) -> list[Any]:
    """A ``.wandb`` file is a LevelDB-style log (32 KiB blocks of crc32 | length | type
    chunks) of ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B"
    block, offset, pending, records = 32768, 7, b"", []
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # the rest of a block is padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if offset + 7 + length > len(data):
            break  # a chunk still being written
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL, LAST
            # The protobuf classes are generated at import time (no stubs): mypy sees none.
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            pending = b""
            records.append(record)
    return records


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


STEPS: list[dict[str, Any]] = [
    {"step": 1, "avg_reward": 0.5, "time/step": 1.25, "optim/kl_sample_train_v1": None},
    {"step": 2, "avg_reward": 0.75, "time/step": 1.0, "optim/kl_sample_train_v1": 0.01},
]


def test_only_finite_numbers_are_tracked() -> None:
    metrics = {
        "step": 3,
        "avg_reward": 0.5,
        "datums": 48,
        "kl": None,
        "nan": float("nan"),
        "flag": True,
        "problem_ids": [1, 2],
        "event": "step",
    }
    assert scalar_metrics(metrics) == {"avg_reward": 0.5, "datums": 48.0}


def test_wandb_offline_run_holds_every_step(tmp_path: Path) -> None:
    sink = WandbSink(tmp_path, {"steps": 2, "loss": "ppo"})
    for metrics in STEPS:
        sink.log_step(metrics["step"], metrics)
    sink.close()
    history = wandb_history(tmp_path)
    assert [h["_step"] for h in history] == [1, 2]
    assert [h["avg_reward"] for h in history] == [0.5, 0.75]
    assert "optim/kl_sample_train_v1" not in history[0]
    assert history[1]["optim/kl_sample_train_v1"] == 0.01


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path / "tb")
    for metrics in STEPS:
        sink.log_step(metrics["step"], metrics)
    sink.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["avg_reward"] == [(1, 0.5), (2, 0.75)]
    assert scalars["time/step"] == [(1, 1.25), (2, 1.0)]
    assert scalars["optim/kl_sample_train_v1"] == [(2, pytest.approx(0.01))]


def test_unknown_tracker_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--log-to must name trackers out of wandb, tensorboard"):
        config_from_sources({"log_to": "wandb,mlflow", "api_key": "sk-x"}, {})
    config = config_from_sources({"log_to": "tensorboard, wandb,tensorboard", "api_key": "sk"}, {})
    assert config.logging.log_to == ("tensorboard", "wandb")


class _BrokenSink:
    def __init__(self) -> None:
        self.closed = False

    def log_step(self, step: int, metrics: Any) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_is_dropped_with_one_warning(tmp_path: Path) -> None:
    console = io.StringIO()
    broken = _BrokenSink()
    log = RunLog(
        tmp_path / "metrics.jsonl", console, "json", [("wandb", broken)], step_detail=RL.step_detail
    )
    for step in (1, 2):
        log.step({"step": step, "avg_reward": 0.5}, line=f"Step {step}")
    log.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    events = [json.loads(line) for line in console.getvalue().splitlines()]
    warnings = [e["message"] for e in events if e["level"] == "warning"]
    assert warnings == [
        "wandb stopped logging at step 1 (OSError('disk full')); metrics.jsonl keeps every step"
    ]
    assert broken.closed


@pytest.mark.slow
def test_a_run_logs_to_both_trackers_and_draws_its_report(tmp_path: Path) -> None:
    with LocalServer(api_key=API_KEY) as server:
        config = small_config(
            server, tmp_path / "run", steps=2, eval_every=2, log_to=("wandb", "tensorboard")
        )
        _, result = run_engine(config)
    run_dir = result.run_dir
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = wandb_history(run_dir)
    assert [h["_step"] for h in history] == [0, 1, 2]
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    # the evaluation of the starting weights (step 0) reaches every tracker, as eval.jsonl
    first_eval = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[0])
    assert first_eval["step"] == 0
    reward0 = pytest.approx(first_eval["eval/reward/total"])
    assert history[0]["eval/reward/total"] == reward0
    assert [s for s, _ in scalars["eval/reward/total"]] == [0, 2]
    assert scalars["eval/reward/total"][0][1] == reward0
    for line, logged in zip(lines, history[1:], strict=True):
        expected = scalar_metrics(line)
        assert {k: v for k, v in logged.items() if not k.startswith("_")} == expected
        for name, value in expected.items():
            at_step = dict(scalars[name])
            assert at_step[line["step"]] == pytest.approx(value)
    config_json = (run_dir / "config.json").read_text()
    assert API_KEY not in config_json
    wandb_config = next(run_dir.glob("wandb/offline-run-*/run-*.wandb")).read_bytes()
    assert API_KEY.encode() not in wandb_config
    assert (run_dir / REPORT_PNG).read_bytes().startswith(b"\x89PNG")
    assert f"![report]({REPORT_PNG})" in (run_dir / "summary.md").read_text()


def test_a_resumed_run_chooses_its_trackers_anew() -> None:
    stored = EngineConfig(api_key="sk-x", log_to=("tensorboard",)).public_dict()
    assert stored["logging"]["log_to"] == ["tensorboard"]
    stored_logging = stored_settings(json.loads(json.dumps(stored)), "config.json").get("logging")
    assert "log_to" not in (stored_logging or {})
