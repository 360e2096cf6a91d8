"""The settings models are the one source of every flag, variable, TOML key, resume rule
and documented default; old TOML files and run dirs keep working; keys stay secret."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.catalog import load_task
from engine.config import (
    GROUPS,
    HOSTED_PROFILE,
    EngineConfig,
    all_settings,
    config_from_sources,
    read_config_file,
    resume_rule,
    stored_settings,
)
from engine.config.sources import default_text, help_text, task_own_settings
from engine.errors import ConfigError, ResumeError
from engine.run import build_parser, parse_config
from engine.rundir.checkpoint_log import CheckpointLog, CheckpointRecord
from engine.rundir.directory import CONFIG_FILE, config_record, load_resume_state, write_config
from scripts.gen_config_table import run_table
from tests.hosted_env import REPO

SOURCES = Path(__file__).resolve().parent.parent / "engine" / "config"

# --------------------------------------------------------------------------- one source


def test_help_and_docs_show_the_models_defaults() -> None:
    help_lines = " ".join(build_parser().format_help().split())
    table = run_table()
    for field in all_settings():
        shown, default = default_text(field), field.default
        if isinstance(default, bool):
            assert shown == ("on" if default else "off")
        elif isinstance(default, int | float):
            assert float(shown) == default
        elif isinstance(default, str):
            assert shown == default
        assert " ".join(help_text(field).split()) in help_lines
        assert f"| `{field.flag}` |" in table and f"`{field.path}`" in table


def test_a_default_is_written_once() -> None:
    """No display copy of a default: ``unset`` only says what None means, and the
    sources hold no ``(default: N)`` texts."""
    for field in all_settings():
        assert field.marker.unset is None or field.default is None, field.path
        assert "(default" not in field.description, field.path
    for source in SOURCES.glob("*.py"):
        assert "default: " not in source.read_text(encoding="utf-8").replace(
            "{env}default: ", ""
        ), source


def test_help_is_grouped_by_concern() -> None:
    text = build_parser().format_help()
    for name in GROUPS:
        assert f"\n{name} settings:\n" in text
    assert "\narithmetic task settings:\n" in text
    assert text.index("\n  --batch ") > text.index("\npipeline settings:")
    assert text.index("\n  --lr ") > text.index("\ntraining settings:")


def test_flags_and_env_names_are_kept() -> None:
    flags = {f.flag for f in all_settings()}
    assert {"--lr", "--task", "--task-arg", "--no-progress", "--seed", "--local"} <= flags
    env = {name for f in all_settings() for name in f.env}
    assert {"MINT_CUSTOM_REWARD_STEPS", "MINT_API_KEY", "TINKER_BASE_URL", "ENGINE_SDK"} <= env


def test_the_second_stages_settings_are_the_first_stages_under_then() -> None:
    """Each ``--then-*`` setting is built from the setting it stands for: its type, check
    and resume rule, its flag and flat name under ``then``; its own aliases are not."""
    by_flat = {f.flat: f for f in all_settings()}
    then = [f for f in all_settings() if f.group == "then" and f.name != "objective"]
    assert [f.flag for f in then] == [
        *("--then-task", "--then-task-arg", "--then-steps", "--then-batch", "--then-lr"),
        *("--then-eval-every", "--then-teacher"),
    ]
    for field in then:
        first = by_flat[field.name]
        assert field.flag == "--then-" + first.flag.removeprefix("--")
        assert field.flat == "then_" + first.flat
        assert (field.value_type, field.marker.check) == (first.value_type, first.marker.check)
        assert field.marker.resume == first.marker.resume
        assert field.env == ("ENGINE_" + field.flat.upper(),)
        assert not field.marker.recommended and field.default in (None, {})
    with pytest.raises(ConfigError, match=r"^then_steps must be positive, got 0$"):
        EngineConfig(then_steps=0)
    assert by_flat["then_learning_rate"].marker.unset == "the server's recommendation"
    assert by_flat["then_steps"].marker.unset == str(by_flat["steps"].default)


FRESH = """
import sys
from engine.config import EngineConfig
config = EngineConfig(op="+", min_operand=1)
print(sorted(config.task.args.items()), [m for m in sys.modules if m.startswith("engine.tasks")])
"""


def test_a_built_in_tasks_settings_need_no_task_imported() -> None:
    """The config knows the arithmetic task's ``--op`` in a fresh interpreter that has
    imported nothing of the tasks (no registration as an import's side effect)."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[('min_operand', '1'), ('op', '+')] []"


def test_every_setting_has_an_engine_variable() -> None:
    """One prefix for all: ENGINE_<flat name>, read before the quickstart's aliases."""
    fields = [*all_settings(), *(f for _, f in task_own_settings())]
    for field in fields:
        assert field.env[0] == "ENGINE_" + field.flat.upper(), field.path
    assert len({f.env[0] for f in fields}) == len(fields)
    both = {"ENGINE_STEPS": "5", "MINT_CUSTOM_REWARD_STEPS": "3"}
    assert config_from_sources({}, both).pipeline.steps == 5


@pytest.mark.parametrize(
    ("environ", "read"),
    [
        ({"ENGINE_BATCH": "3"}, lambda c: c.pipeline.batch == 3),
        ({"ENGINE_LEARNING_RATE": "1e-4"}, lambda c: c.training.learning_rate == 1e-4),
        ({"ENGINE_LOSS": "dro"}, lambda c: c.training.loss == "dro"),
        ({"ENGINE_STOP_AT_EOS": "true"}, lambda c: c.sampling.stop_at_eos),
        ({"ENGINE_PROGRESS": "false"}, lambda c: not c.logging.progress),
        ({"ENGINE_RUN_DIR": "runs/x"}, lambda c: c.logging.run_dir == Path("runs/x")),
        ({"ENGINE_TASK": "guess-sum"}, lambda c: c.task.spec == "guess-sum"),
        ({"ENGINE_TASK_ARGS": "reward=numeric,chat=true"}, lambda c: c.task.args["chat"] == "true"),
        ({"ENGINE_TASK_ARGS": '{"rubric": "a, b"}'}, lambda c: c.task.args == {"rubric": "a, b"}),
        ({"ENGINE_OP": "-"}, lambda c: c.task.args == {"op": "-"}),
        ({"ENGINE_API_KEY": "sk-x"}, lambda c: not c.session.local),
    ],
)
def test_engine_variables_are_read(environ: dict[str, str], read: Any) -> None:
    assert read(config_from_sources({}, environ))


def test_engine_variable_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"^ENGINE_LOSS must be one of importance_sampling"):
        config_from_sources({}, {"ENGINE_LOSS": "ppo2"})
    with pytest.raises(ConfigError, match=r"^ENGINE_TASK_ARGS must be KEY=VALUE"):
        config_from_sources({}, {"ENGINE_TASK_ARGS": "chat"})


def test_help_shows_types_and_choices_not_value() -> None:
    text = build_parser().format_help()
    assert not re.search(r"--[a-z-]+ VALUE\b", text)
    assert "--loss {importance_sampling,ppo,cispo,dro,gspo,stable_reinforce}" in text
    assert "--op {+,-,*}" in text
    assert "--batch INT" in text and "--lr NUMBER" in text and "--run-dir PATH" in text
    assert "--log-to NAME[,NAME...]" in text
    assert "env ENGINE_BATCH / MINT_CUSTOM_REWARD_BATCH; default: 8" in " ".join(text.split())


def test_a_mistyped_flag_gets_the_nearest_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--bacth", "3"], {})
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "Error: unrecognized argument --bacth (did you mean --batch?) (see --help)"
    )
    with pytest.raises(SystemExit):
        parse_config(["--temprature=1"], {})
    assert "did you mean --temperature or --loss-temperature?" in capsys.readouterr().err


# --------------------------------------------------------------------------- sources


@pytest.mark.parametrize(
    ("name", "text", "path", "value"),
    [
        ("MINT_CUSTOM_REWARD_STEPS", "3", "pipeline.steps", 3),
        ("MINT_CUSTOM_REWARD_BATCH", "4", "pipeline.batch", 4),
        ("MINT_CUSTOM_REWARD_GROUP", "2", "pipeline.group", 2),
        ("MINT_CUSTOM_REWARD_LR", "1e-3", "training.learning_rate", 1e-3),
        ("MINT_CUSTOM_REWARD_MAX_TOKENS", "9", "sampling.max_tokens", 9),
        ("MINT_CUSTOM_REWARD_TEMPERATURE", "1.5", "sampling.temperature", 1.5),
        ("MINT_LORA_RANK", "4", "model.lora_rank", 4),
        ("ENGINE_LOG_LEVEL", "debug", "logging.log_level", "debug"),
        ("ENGINE_SDK", "mint", "session.sdk", "mint"),
    ],
)
def test_environment_variables(name: str, text: str, path: str, value: Any) -> None:
    config = config_from_sources({}, {name: text})
    group, field = path.split(".")
    assert getattr(getattr(config, group), field) == value
    with pytest.raises(ConfigError, match=f"^{name} must be"):
        config_from_sources({}, {name: "not-a-value"})


def test_nested_and_legacy_flat_toml_read_alike(tmp_path: Path) -> None:
    nested = tmp_path / "nested.toml"
    nested.write_text(
        "[pipeline]\nbatch = 4\nmax-steps-off-policy = 2\n[training]\nlr = 1e-3\n"
        '[sampling]\nstop_at_eos = true\n[task]\nspec = "arithmetic"\n'
        '[task.args]\nop = "-"\n[logging]\nlog_to = ["tensorboard"]\n'
    )
    flat = tmp_path / "flat.toml"
    flat.write_text(
        "batch = 4\nmax-steps-off-policy = 2\nlr = 1e-3\nstop-at-eos = true\n"
        'task = "arithmetic"\nop = "-"\nlog-to = "tensorboard"\n'
    )
    assert read_config_file(nested) == read_config_file(flat)
    config = parse_config(["--config", str(nested)], {})
    assert (config.pipeline.batch, config.pipeline.max_steps_off_policy) == (4, 2)
    assert (config.training.learning_rate, config.sampling.stop_at_eos) == (1e-3, True)
    assert config.task.args == {"op": "-"}
    assert parse_config(["--config", str(nested), "--batch", "2"], {}).pipeline.batch == 2


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "[pipeline]\nbatchh = 4\n",
            r"^pipeline.batchh in .* is not a setting \(did you mean batch\?\)",
        ),
        ("lerning_rate = 1e-3\n", r"^lerning_rate in .* \(did you mean learning_rate"),
        ("[samplng]\ntemperature = 1\n", r"^samplng in .* not a setting \(did you mean sampling"),
        ("[pipeline]\nbatch = 0\n", r"^pipeline.batch in .* must be positive, got '0'$"),
        ("batch = 'x'\n", r"^batch in .* must be an integer, got 'x'$"),
        ("[session]\napi_key = 'sk-x'\n", r"keep API keys out of files"),
        ("api-key = 'sk-x'\n", r"keep API keys out of files"),
    ],
)
def test_toml_errors_name_the_key(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        read_config_file(path)


def test_flat_keywords_and_groups_build_the_same_config() -> None:
    flat = EngineConfig(batch=4, loss="dro")
    nested = EngineConfig(pipeline={"batch": 4}, training={"loss": "dro"})
    assert flat == nested
    assert flat.replace(steps=2).pipeline == nested.pipeline.model_copy(update={"steps": 2})
    with pytest.raises(ConfigError, match=r"^bacth is not a setting \(did you mean batch\?\)"):
        EngineConfig(bacth=4)
    with pytest.raises(ConfigError, match=r"^op only apply to the arithmetic task"):
        EngineConfig(task="jsonl:data.jsonl", op="+")


# --------------------------------------------------------------------------- run dirs

LEGACY_RECORD = {
    # config.json as a run from before the settings groups wrote it
    "base_model": "tiny",
    "lora_rank": 8,
    "learning_rate": 0.001,
    "steps": 4,
    "batch": 2,
    "group": 3,
    "max_tokens": 8,
    "temperature": 0.8,
    "seed": 7,
    "loss": "ppo",
    "task": "arithmetic",
    "task_args": {"op": "+", "min_operand": "10", "max_operand": "99", "eval_size": "0"},
    "op": None,
    "min_operand": None,
    "max_operand": None,
    "local": True,
    "stop_at_eos": False,
    "progress": True,
    "log_to": [],
    "run_dir": "/somewhere/else",
    "server": "local",
    "task_name": "arithmetic-add",
    "task_repr": "<ArithmeticTask at 0x1>",
}


def _run_dir(tmp_path: Path, record: dict[str, Any]) -> Path:
    run_dir = tmp_path / "run"
    write_config(run_dir, record)
    CheckpointLog(run_dir).append(
        CheckpointRecord(
            step=2,
            reason="periodic",
            state_path="tinker://x/weights/2",
            sampler_path="tinker://x/sampler_weights/2",
            loop_state={},
        )
    )
    return run_dir


def test_a_legacy_run_dir_resumes(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, LEGACY_RECORD)
    config = parse_config(["--resume", str(run_dir), "--steps", "6"], {})
    assert (config.pipeline.steps, config.pipeline.batch, config.task.seed) == (6, 2, 7)
    assert config.model.lora_rank == 8 and config.training.learning_rate == 0.001
    assert config.logging.run_dir is None  # a resume runs in its own directory
    assert config.task.args == LEGACY_RECORD["task_args"]
    resolved = config.resolved(HOSTED_PROFILE)
    task = load_task(resolved.task.spec, resolved.task.args)
    state = load_resume_state(run_dir, current_config=config_record(resolved, task))
    assert state.step == 2
    changed = resolved.replace(batch=3)
    with pytest.raises(ResumeError, match=r"pipeline.batch is 2 in the run dir but 3 now"):
        load_resume_state(run_dir, current_config=config_record(changed, task))


def test_a_new_run_dir_records_the_groups_and_resumes(tmp_path: Path) -> None:
    config = EngineConfig(local=True, batch=2, lora_rank=4, learning_rate=1e-3, base_model="m")
    record = config_record(config.resolved(HOSTED_PROFILE), None)
    assert record["pipeline"]["batch"] == 2 and record["server"] == "local"
    run_dir = _run_dir(tmp_path, record)
    resumed = parse_config(["--resume", str(run_dir)], {})
    assert resumed.resolved() == config.resolved(HOSTED_PROFILE).replace(resume=run_dir)


def test_resume_rules_come_from_the_markers() -> None:
    assert resume_rule("pipeline.steps") == "changeable"
    assert resume_rule("session.request_timeout") == "changeable"
    assert resume_rule("pipeline.batch") == "fixed"
    assert resume_rule("task.args.op") == "fixed"
    assert resume_rule("session.base_url") == "current"
    assert resume_rule("logging.log_to.0") == "current"
    current = {f.path for f in all_settings() if f.marker.resume == "current"}
    stored = stored_settings(json.loads(json.dumps(EngineConfig(local=True).public_dict())), "x")
    assert not current & {f"{g}.{k}" for g, values in stored.items() for k in values}


def test_secrets_never_reach_the_record(tmp_path: Path) -> None:
    key = "sk-secret-value-123456"
    config = EngineConfig(api_key=key, base_url="http://h")
    assert key not in repr(config) and key not in str(config)
    assert config.session.api_key_value == key
    record = config_record(config, None)
    assert "api_key" not in record["session"]
    write_config(tmp_path, record)
    assert key not in (tmp_path / CONFIG_FILE).read_text()
    leaked = {**LEGACY_RECORD, "api_key": key}
    assert "api_key" not in stored_settings(leaked, "x").get("session", {})


def test_engine_resume_reads_the_run_dirs_settings(tmp_path: Path) -> None:
    with pytest.raises(ResumeError):
        parse_config([], {"ENGINE_RESUME": str(tmp_path / "no-run")})


def test_a_resumed_run_keeps_its_settings_by_one_rule_embedded_and_from_the_cli(
    tmp_path: Path,
) -> None:
    """Embedded (``EngineConfig(resume=...)``) and from the command line alike, a resumed
    run keeps what it was started with unless a setting is given anew; task arguments
    merge key by key."""
    from engine.engine import prepare_run

    started = EngineConfig(local=True, batch=3, group=5, steps=4, task_args={"op": "-"})
    run_dir = _run_dir(tmp_path, config_record(started.resolved(HOSTED_PROFILE), None))
    embedded, _ = prepare_run(EngineConfig(local=True, resume=run_dir, steps=6), None)
    cli = parse_config(["--resume", str(run_dir), "--steps", "6"], {})
    for config in (embedded, cli):
        assert (config.pipeline.batch, config.pipeline.group) == (3, 5)  # kept
        assert config.pipeline.steps == 6  # given anew
        assert config.task.args["op"] == "-"
    regrouped, _ = prepare_run(EngineConfig(local=True, resume=run_dir, group=2), None)
    assert (regrouped.pipeline.batch, regrouped.pipeline.group) == (3, 2)


def test_directory_settings_expand_the_home_directory_as_the_cli_does() -> None:
    assert EngineConfig(resume="~/runs/a").checkpoints.resume == Path.home() / "runs" / "a"
    assert EngineConfig(run_dir="~/runs/b").logging.run_dir == Path.home() / "runs" / "b"
    EngineConfig(resume="~/runs/a", run_dir=Path.home() / "runs" / "a")  # one directory
    assert EngineConfig().checkpoints.resume is None
