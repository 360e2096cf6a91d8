"""``judge.api=local``: the judge is the model of the run's own server, sampled through
the run's session -- the local server the engine starts itself, no second server, no
URL, no ``MINT_API_KEY`` -- end to end; and what the arguments refuse, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.catalog import load_task
from engine.errors import ConfigError
from engine.tasks.judge import JUDGE_LOG, JudgedTask
from engine.tasks.judge_task import SessionJudgeModel
from tests.engine_support import run_engine


def test_the_engines_own_local_server_judges_a_run_without_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("MINT_API_KEY", "OPENAI_API_KEY", "ENGINE_JUDGE_API_KEY", "MINT_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    config = EngineConfig(
        local=True,
        task="judge:arithmetic",
        task_args={"judge.api": "local", "judge.verdict": "same-number", "judge.max_tokens": "8"},
        steps=2,
        batch=2,
        group=2,
        max_tokens=8,
        run_dir=tmp_path / "run",
    )
    steps, result = run_engine(config)
    assert result.steps_completed == 2
    calls = [s.metrics["judge/calls"] for s in steps]
    assert calls[-1] >= 4  # every distinct response of the run was judged
    assert all(s.metrics["judge/retries"] == 0.0 for s in steps)
    assert steps[-1].metrics["judge/completion_tokens"] > 0
    samples = [json.loads(line) for line in (result.run_dir / JUDGE_LOG).read_text().splitlines()]
    assert samples and all("What is" in s["prompt"] for s in samples)


def test_a_local_judge_takes_no_url_and_a_checkpoint_by_its_sampler_path() -> None:
    base = load_task("judge:arithmetic", {"judge.api": "local"})
    assert isinstance(base, JudgedTask) and isinstance(base.judge.model, SessionJudgeModel)
    trained = {"judge.api": "local", "judge.model": "tinker://run/sampler_weights/000010"}
    assert isinstance(load_task("judge:arithmetic", trained), JudgedTask)
    with pytest.raises(ConfigError, match="api=local judges with the run"):
        load_task("judge:arithmetic", {"judge.api": "local", "judge.url": "http://h:1/v1"})
    with pytest.raises(ConfigError, match="a checkpoint's sampler path"):
        load_task("judge:arithmetic", {"judge.api": "local", "judge.model": "grader"})
    with pytest.raises(ConfigError, match="openai, mint or local"):
        load_task("judge:arithmetic", {"judge.api": "hosted"})
