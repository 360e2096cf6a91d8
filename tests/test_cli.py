"""``python -m engine.run``: bad input is exit code 2 and exactly one line on stderr."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import HOSTED_PROFILE, EngineConfig, config_from_sources
from engine.errors import ConfigError
from engine.run import build_parser, main
from engine.session.preflight import local_server_profile

# A real-server end-to-end set: deselected by default, run with -m slow (CI runs both).
pytestmark = pytest.mark.slow

ENV_NAMES = (
    "MINT_API_KEY",
    "TINKER_API_KEY",
    "MINT_BASE_URL",
    "TINKER_BASE_URL",
    "MINT_BASE_MODEL",
    "MINT_LORA_RANK",
    "MINT_CUSTOM_REWARD_STEPS",
    "MINT_CUSTOM_REWARD_BATCH",
    "MINT_CUSTOM_REWARD_GROUP",
    "MINT_CUSTOM_REWARD_LR",
    "MINT_CUSTOM_REWARD_MAX_TOKENS",
    "MINT_CUSTOM_REWARD_TEMPERATURE",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


BAD_INPUT = [
    (
        [],
        {"MINT_CUSTOM_REWARD_BATCH": "abc"},
        "Error: MINT_CUSTOM_REWARD_BATCH must be an integer, got 'abc'",
    ),
    (
        [],
        {"MINT_CUSTOM_REWARD_LR": "fast"},
        "Error: MINT_CUSTOM_REWARD_LR must be a number, got 'fast'",
    ),
    (
        [],
        {"MINT_CUSTOM_REWARD_GROUP": "0"},
        "Error: MINT_CUSTOM_REWARD_GROUP must be positive, got '0'",
    ),
    (["--batch", "0"], {}, "Error: --batch must be positive, got '0'"),
    (["--steps", "-3"], {}, "Error: --steps must be positive, got '-3'"),
    (
        ["--max-steps-off-policy", "-1"],
        {},
        "Error: --max-steps-off-policy must be >= 0, got '-1'",
    ),
    (
        ["--loss", "mse"],
        {},
        "Error: --loss must be one of importance_sampling, ppo, cispo, dro, gspo, "
        "stable_reinforce, got 'mse'",
    ),
    (
        ["--on-missing-logprobs", "zero"],
        {},
        "Error: --on-missing-logprobs must be one of error, drop, got 'zero'",
    ),
    (["--op", "/"], {}, "Error: --op must be one of +, -, *, got '/'"),
    (["--lr", "nan"], {}, "Error: --lr must be a positive number, got 'nan'"),
    (
        ["--min-operand", "50", "--max-operand", "10"],
        {},
        "Error: invalid arithmetic task: min operand 50 is greater than max operand 10",
    ),
    (
        ["--task", "no_such_pkg.tasks:mine"],
        {},
        "Error: invalid task 'no_such_pkg.tasks:mine': cannot import 'no_such_pkg.tasks' "
        "(No module named 'no_such_pkg')",
    ),
    (
        ["--task", "fractions:NoSuchTask"],
        {},
        "Error: invalid task 'fractions:NoSuchTask': 'fractions' has no attribute 'NoSuchTask'",
    ),
    (
        ["--task", "fractions:Fraction"],
        {},
        "Error: invalid task 'fractions:Fraction': Fraction is not a Task "
        "(missing name, source, prompt, score)",
    ),
    (
        ["--task", "just-a-name"],
        {},
        "Error: invalid task 'just-a-name': use 'arithmetic', 'jsonl:PATH', 'hf:PATH', "
        "'guess-sum', 'calculator', 'package.module:attr' or 'judge:SPEC'",
    ),
    (
        [],
        {"MINT_BASE_URL": "http://127.0.0.1:1"},
        "Error: MINT_BASE_URL is set but MINT_API_KEY is not: set both to use that server, "
        "or neither to start the local server",
    ),
    (["--bogus"], {}, "Error: unrecognized arguments: --bogus (see --help)"),
    # seeds travel as signed 64-bit integers: out of range is one line, not 5 retries
    (
        ["--seed", str(2**63)],
        {},
        f"Error: --seed must be an integer in 0..{2**63 - 1} (2^63-1), got '{2**63}'",
    ),
    (
        ["--sampling-seed", "-1"],
        {},
        f"Error: --sampling-seed must be an integer in 0..{2**63 - 1} (2^63-1), got '-1'",
    ),
    (
        ["--lora-seed", str(2**64)],
        {},
        f"Error: --lora-seed must be an integer in 0..{2**63 - 1} (2^63-1), got '{2**64}'",
    ),
    (
        [],
        {"MINT_BASE_URL": "notaurl", "MINT_API_KEY": "sk-test"},
        "Error: MINT_BASE_URL must be an http:// or https:// URL with a host, e.g. "
        "https://mint.macaron.xin/, got 'notaurl'",
    ),
    (
        ["--base-url", "http://:8000"],
        {"MINT_API_KEY": "sk-test"},
        "Error: --base-url must be an http:// or https:// URL with a host, e.g. "
        "https://mint.macaron.xin/, got 'http://:8000'",
    ),
    (
        ["--base-url", "http://127.0.0.1:port"],
        {"MINT_API_KEY": "sk-test"},
        "Error: --base-url must be an http:// or https:// URL with a host, e.g. "
        "https://mint.macaron.xin/, got 'http://127.0.0.1:port'",
    ),
    # '' would be the current directory: the user's own config.json and summary.md
    (["--run-dir", ""], {}, "Error: --run-dir must be a non-empty path, got ''"),
    (
        ["--temperature", "0"],
        {},
        "Error: --temperature must be > 0: temperature 0 samples greedily, so every "
        "response of a group is the same, no group has a reward difference and nothing is "
        "trained, got '0'",
    ),
    (
        ["--group", "1"],
        {},
        "Error: --group must be at least 2 with --objective rl, got 1: an advantage is a "
        "response's reward minus its group's mean, so a group of one never trains",
    ),
    (
        ["--local-model", "/no/such/model/dir"],
        {},
        "Error: --local-model must be an existing directory or one of tiny-arith, "
        "tiny-agent-2, tiny-code, smollm2-135m, got '/no/such/model/dir'",
    ),
]


@pytest.mark.parametrize(("argv", "env", "message"), BAD_INPUT)
def test_bad_input_exits_2_with_one_line(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert code == 2
    assert err == message + "\n"
    assert out == ""
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_bad_input_from_a_real_process_has_no_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    env["MINT_CUSTOM_REWARD_BATCH"] = "abc"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr == "Error: MINT_CUSTOM_REWARD_BATCH must be an integer, got 'abc'\n"
    assert proc.stdout == ""


def test_help_names_every_env_variable_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in ENV_NAMES[:2] + ENV_NAMES[4:]:
        assert name in text
    assert "env ENGINE_BATCH / MINT_CUSTOM_REWARD_BATCH; default: 8" in text
    assert "--max-steps-off-policy" in text and "--stream-minibatches" in text
    assert "--local-model" in text and "--run-dir" in text and "--log-format" in text


def test_flags_beat_env_which_beats_profile() -> None:
    cfg = config_from_sources(
        {"batch": "3", "learning_rate": "1e-3"},
        {"MINT_CUSTOM_REWARD_BATCH": "5", "MINT_CUSTOM_REWARD_STEPS": "2", "MINT_LORA_RANK": "4"},
    )
    assert (cfg.pipeline.batch, cfg.pipeline.steps) == (3, 2)
    assert cfg.uses_local_server
    local = cfg.resolved(local_server_profile(None))
    assert (local.training.learning_rate, local.model.lora_rank) == (1e-3, 4)
    assert local.task.args == {"op": "+", "min_operand": "10", "max_operand": "99"}
    hosted = config_from_sources({}, {"MINT_API_KEY": "sk-abcdefghijkl"}).resolved(HOSTED_PROFILE)
    assert not hosted.uses_local_server
    assert (hosted.model.base_model, hosted.training.learning_rate, hosted.model.lora_rank) == (
        "Qwen/Qwen3-0.6B",
        2e-5,
        16,
    )
    assert hosted.task.args == {"op": "*", "min_operand": "10", "max_operand": "199"}
    # TINKER_* are the fallbacks, as in the quickstart
    tinker = config_from_sources(
        {}, {"TINKER_API_KEY": "tml-abcdefgh", "TINKER_BASE_URL": "http://tinker.test"}
    )
    assert tinker.session.api_key_value == "tml-abcdefgh"
    assert tinker.session.base_url == "http://tinker.test"


def test_api_key_never_reaches_config_dict_or_repr() -> None:
    cfg = EngineConfig(api_key="sk-secret-value-123", base_url="http://h")
    assert "sk-secret" not in repr(cfg)
    assert "api_key" not in cfg.public_dict()
    assert "sk-secret" not in str(cfg.public_dict())


def test_embedding_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^batch must be positive, got 0$"):
        EngineConfig(batch=0)
    with pytest.raises(ConfigError, match=r"^max_steps_off_policy must be >= 0, got -2$"):
        EngineConfig(max_steps_off_policy=-2)
    with pytest.raises(ConfigError, match=r"^loss must be one of"):
        EngineConfig(loss="sgd")  # type: ignore[arg-type]


def test_loss_configs_sent_with_forward_backward() -> None:
    def sent(**settings: object) -> dict[str, float] | None:
        return EngineConfig(**settings).training.loss_fn_config(0.8)

    assert sent(loss="importance_sampling") is None
    assert sent(loss="ppo", clip_low=0.7, clip_high=1.3) == {
        "clip_low_threshold": 0.7,
        "clip_high_threshold": 1.3,
    }
    assert sent(loss="cispo") == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert sent(loss="dro", dro_beta=0.2) == {"beta": 0.2}


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


STEP_LINE = re.compile(
    r"^Step (\d+): avg_reward=\d\.\d{3}, exact_rate=\d{1,3}\.\d%, "
    r"format_rate=\d{1,3}\.\d%, datums=\d+$"
)


def test_default_run_against_the_local_server_leaves_a_readable_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.run", "--run-dir", str(run_dir)],
        env=_cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert "Connecting to MinT server..." in out
    assert out[out.index("Connecting to MinT server...") + 1].startswith(
        "Endpoint: http://127.0.0.1:"
    )
    step_lines = [line for line in out if line.startswith("Step ")]
    assert [int(STEP_LINE.match(line).group(1)) for line in step_lines] == list(range(1, 9))  # type: ignore[union-attr]
    assert out[-2:][0] == "" and out[-1].startswith("Saved: tinker://")
    assert "Traceback" not in proc.stderr

    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == list(range(1, 9))
    # pipelined by default: K=1 with the clipped ppo loss
    assert all(e["off_policy/staleness"] <= 1 for e in events)
    assert any(e["off_policy/staleness"] == 1 for e in events)
    config = json.loads((run_dir / "config.json").read_text())
    pipeline = config["pipeline"]
    assert (pipeline["steps"], pipeline["batch"], pipeline["group"]) == (8, 8, 6)
    assert config["server"] == "local"
    # No --eval-every: no held-out pairs, exactly the quickstart's problems.
    assert config["task"]["args"] == {
        **local_server_profile(None).task_args["arithmetic"],
        "eval_size": "0",
    }
    summary = (run_dir / "summary.md").read_text()
    assert "status: **finished**" in summary
    assert out[-1].removeprefix("Saved: ") in summary


def test_json_log_format_and_env_knobs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "engine.run", "--log-format", "json", "--run-dir", "r"],
        env=_cli_env(
            MINT_CUSTOM_REWARD_STEPS="2",
            MINT_CUSTOM_REWARD_BATCH="3",
            MINT_CUSTOM_REWARD_GROUP="4",
            MINT_CUSTOM_REWARD_MAX_TOKENS="6",
        ),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]  # every line is JSON
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2]
    assert all(e["groups/total"] == 3 for e in steps)
    saved = [e for e in events if e["event"] == "saved"]
    assert len(saved) == 1
    assert proc.stderr.splitlines()[-1] == f"Saved: {saved[0]['path']}"


def test_a_directory_that_is_not_a_model_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "not-a-model").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "engine.run", "--local-model", "not-a-model", "--run-dir", "r"],
        env=_cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("Error: cannot start the local server: ")
    assert "not-a-model" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_runtime_failure_is_one_error_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.run", "--base-model", "m", "--run-dir", "r"],
        env=_cli_env(MINT_API_KEY="sk-test-secret-key-123456", MINT_BASE_URL=url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert proc.stderr == (
        f"Error: cannot reach the MinT server at {url} (connection refused); "
        "check MINT_BASE_URL, the network and the server's status\n"
    )
    assert proc.stdout.splitlines() == ["Connecting to MinT server...", f"Endpoint: {url}"]
    assert "sk-test-secret" not in (tmp_path / "r" / "config.json").read_text()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith(f"cannot reach the MinT server at {url}")
    assert "status: **failed**" in (tmp_path / "r" / "summary.md").read_text()


def test_every_setting_is_a_flag_in_its_group() -> None:
    from engine.config import GROUPS, all_settings

    groups: dict[str, argparse._ArgumentGroup] = {}
    for g in build_parser()._action_groups:
        assert g.title is not None
        groups[g.title] = g
    for field in all_settings():
        group = groups[f"{field.group} settings"]
        assert field.flag in {s for a in group._group_actions for s in a.option_strings}
    assert set(GROUPS) == {
        t.removesuffix(" settings") for t in groups if t.endswith(" settings")
    } - {"arithmetic task"}
    flags = build_parser().format_help()
    for switch in ("--local", "--stop-at-eos", "--no-progress", "--init-from-optimizer"):
        assert switch in flags
