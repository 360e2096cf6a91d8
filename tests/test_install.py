"""The light install: the core package with an SDK (``engine[mint]``) works without the
other extras' packages
(torch, peft, accelerate, FastAPI, uvicorn, PyJWT, matplotlib, wandb, tensorboard,
datasets), and
asking for what an extra provides is one line that says what to install (exit 2).

Most tests run the package in a child process that cannot find those packages
(``tests/hosted_env.py``), as a hosted-only install sees it. The last one builds a real
fresh virtual environment with ``pip install -c constraints.txt '.[mint]'``; it needs the
packages from an index or a warm pip cache and 1-5 minutes (the install alone measured
36-44 s on an idle machine, 270 s for the whole test under load), so it is opt-in:
``ENGINE_TEST_FRESH_VENV=1``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from engine.common.cli import engine_version, program_name
from engine.local import LocalServer
from tests.engine_support import API_KEY
from tests.hosted_env import REPO, modules_of, run_without

HOSTED_ONLY = modules_of("local", "report", "wandb", "tensorboard", "datasets")
TINY_RUN = ("--steps", "2", "--batch", "2", "--group", "2", "--max-tokens", "4", "--no-progress")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_", "WANDB"))}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr[-2000:]
    return done.stderr.strip()


def test_the_core_imports_and_every_command_answers_help_and_version() -> None:
    for module in ("engine.run", "engine.report", "engine.local"):
        done = run_without(HOSTED_ONLY, module, ["--help"], env=clean_env())
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith(f"usage: python -m {module} ")
        done = run_without(HOSTED_ONLY, module, ["--version"], env=clean_env())
        assert done.stdout == f"python -m {module} {engine_version()}\n"
    done = run_without(HOSTED_ONLY, "engine", [], env=clean_env())
    assert "No module named engine.__main__" in done.stderr  # nothing to run, but importable


def test_the_local_server_without_its_extra_says_how_to_install_it() -> None:
    line = one_error_line(run_without(modules_of("local"), "engine.local", [], env=clean_env()))
    assert line.startswith("python -m engine.local: error: the local server needs the 'local' ")
    assert line.endswith("pip install 'engine[local]'")
    assert "torch" in line and "fastapi" in line


def test_a_run_without_key_and_without_the_local_extra_is_one_line(tmp_path: Path) -> None:
    done = run_without(
        modules_of("local"), "engine.run", ["--run-dir", str(tmp_path / "r")], env=clean_env()
    )
    line = one_error_line(done)
    assert line.startswith("Error: the local server (no MINT_API_KEY set, or --local) ")
    assert line.endswith("pip install 'engine[local]'")
    assert not (tmp_path / "r").exists()  # refused before anything started


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_a_tracker_without_its_extra_is_refused_before_the_run(
    tmp_path: Path, tracker: str
) -> None:
    env = clean_env(MINT_API_KEY="sk-never-used", MINT_BASE_URL="http://127.0.0.1:9")
    args = ["--log-to", tracker, "--run-dir", str(tmp_path / "r")]
    line = one_error_line(run_without([tracker], "engine.run", args, env=env))
    assert line == (
        f"Error: --log-to {tracker} needs the '{tracker}' extra ({tracker} not installed): "
        f"pip install 'engine[{tracker}]'"
    )
    assert not (tmp_path / "r").exists()


def test_an_hf_task_without_the_datasets_extra_is_refused_before_the_run(tmp_path: Path) -> None:
    env = clean_env(MINT_API_KEY="sk-never-used", MINT_BASE_URL="http://127.0.0.1:9")
    args = ["--task", f"hf:{tmp_path}", "--run-dir", str(tmp_path / "r")]
    line = one_error_line(run_without(modules_of("datasets"), "engine.run", args, env=env))
    assert line == (
        "Error: --task hf:PATH needs the 'datasets' extra (datasets not installed): "
        "pip install 'engine[datasets]'"
    )
    assert not (tmp_path / "r").exists()


def test_the_report_without_matplotlib_says_how_to_install_it(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "avg_reward": 0.5}\n')
    done = run_without(["matplotlib"], "engine.report", [str(tmp_path)], env=clean_env())
    assert one_error_line(done) == (
        "Error: the report picture needs the 'report' extra (matplotlib not installed): "
        "pip install 'engine[report]'"
    )


@pytest.mark.slow
def test_a_hosted_only_client_trains_against_a_separately_started_server(
    tmp_path: Path,
) -> None:
    """The engine without any extra, against a local server it did not start: the run
    finishes and says once how to get the picture."""
    with LocalServer(api_key=API_KEY) as server:
        env = clean_env(MINT_BASE_URL=server.base_url, MINT_API_KEY=API_KEY)
        run_dir = tmp_path / "run"
        args = [*TINY_RUN, "--run-dir", str(run_dir)]  # the server's recommended settings
        done = run_without(HOSTED_ONLY, "engine.run", args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("Saved: tinker://")
    notes = [line for line in lines if "report.png" in line]
    assert notes == [
        "No report.png: the report picture needs the 'report' extra (matplotlib not "
        "installed): pip install 'engine[report]'; then: python -m engine.report "
        f"{run_dir}"
    ]
    assert not (run_dir / "report.png").exists()
    assert f"`python -m engine.report {run_dir}` draws it" in (run_dir / "summary.md").read_text()


def test_console_scripts_show_their_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/venv/bin/engine-run", "--help"])
    assert program_name("engine.run", "engine-run") == "engine-run"
    monkeypatch.setattr(sys, "argv", [str(REPO / "engine" / "run.py")])
    assert program_name("engine.run", "engine-run") == "python -m engine.run"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {
        "engine-run": "engine.run:main",
        "engine-local": "engine.local.__main__:main",
        "engine-report": "engine.report:main",
    }


def test_the_package_ships_its_type_information() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["engine"]
    assert (REPO / "engine" / "py.typed").is_file()


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("ENGINE_TEST_FRESH_VENV") != "1",
    reason="builds a fresh venv from an index or a warm pip cache: ENGINE_TEST_FRESH_VENV=1",
)
def test_the_core_package_installs_into_a_fresh_venv_and_trains(tmp_path: Path) -> None:
    source = tmp_path / "source"  # setuptools builds in the tree: keep the checkout clean
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "runs", "__pycache__"),
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run(
        [*pip, "-c", str(source / "constraints.txt"), f"{source}[mint]"], check=True, timeout=600
    )
    python = str(venv / "bin" / "python")
    probe = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u, engine, pathlib; "
            "print([m for m in ('torch', 'fastapi', 'uvicorn', 'peft', 'matplotlib') "
            "if u.find_spec(m)], (pathlib.Path(engine.__file__).parent / 'py.typed').is_file())",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert probe.stdout.strip() == "[] True"
    version = subprocess.run(
        [str(venv / "bin" / "engine-run"), "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert version.stdout == f"engine-run {engine_version()}\n"
    with LocalServer(api_key=API_KEY) as server:
        env = {
            k: v
            for k, v in clean_env(MINT_BASE_URL=server.base_url, MINT_API_KEY=API_KEY).items()
            if k != "PYTHONPATH"
        }
        done = subprocess.run(
            [str(venv / "bin" / "engine-run"), *TINY_RUN, "--run-dir", "run"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=tmp_path,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("Saved: tinker://")
