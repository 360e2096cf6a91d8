"""The engine end to end on either SDK generation: ``python -m engine.run`` trains
against a local server it did not start, checkpoints, and resumes, once with the
``mint`` adapter (tinker 0.22, this environment) and once with the ``tinker`` adapter
(tinker 0.38, ``.venv-tinker``; see tests/tinker_env.py for when that is skipped).

The server runs in this process (from ``.venv``, which has torch); the engine runs as
a subprocess of the chosen environment's Python on this checkout's code.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.local import LocalServer
from engine.rundir.rollout_log import ROLLOUTS_FILE
from tests.tinker_env import REPO, tinker_python

# A real-server end-to-end set: deselected by default, run with -m slow (CI runs both).
pytestmark = pytest.mark.slow

KEY = "tml-sdk-matrix-key"
RUN = ("--batch", "2", "--group", "2", "--max-tokens", "4", "--no-progress")
SFT_DATA = REPO / "examples" / "sft_repeat.jsonl"
RUN_TIMEOUT_S = 900  # a loaded 2-core machine; a run takes seconds idle


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def agent_server() -> Iterator[LocalServer]:
    """The local server with the packaged agent model (it knows the tool-call format)."""
    with LocalServer(AGENT_MODEL_DIR, api_key=KEY) as running:
        yield running


def python_of(sdk: str) -> Path:
    return Path(sys.executable) if sdk == "mint" else tinker_python()


def engine_run(
    sdk: str, server: LocalServer, *args: str, key: str = KEY
) -> subprocess.CompletedProcess[str]:
    """``python -m engine.run`` of this checkout with ``sdk``'s environment, the API key
    and base URL in the variables that SDK's users set."""
    prefix = "MINT" if sdk == "mint" else "TINKER"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    env.update(
        {
            f"{prefix}_API_KEY": key,
            f"{prefix}_BASE_URL": server.base_url,
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return subprocess.run(
        [str(python_of(sdk)), "-m", "engine.run", *RUN, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
        cwd=REPO,
    )


def steps_of(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row["step"] for row in map(json.loads, lines) if "avg_reward" in row]


@pytest.mark.slow
@pytest.mark.parametrize("sdk", ["mint", "tinker"])
def test_the_engine_trains_checkpoints_and_resumes(
    server: LocalServer, sdk: str, tmp_path: Path
) -> None:
    python_of(sdk)  # skip before anything runs
    run_dir = tmp_path / "run"
    done = engine_run(
        sdk, server, "--steps", "3", "--checkpoint-every", "2", "--run-dir", str(run_dir)
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines()[-1].startswith("Saved: tinker://")
    assert steps_of(run_dir) == [1, 2, 3]
    assert json.loads((run_dir / "config.json").read_text())["session"]["sdk"] == sdk

    resumed = engine_run(sdk, server, "--resume", str(run_dir), "--steps", "5")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert steps_of(run_dir) == [1, 2, 3, 4, 5]
    checkpoints = [
        json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()
    ]
    assert [c["loop_state"]["next_step"] for c in checkpoints][-1] == 5
    assert "FutureWarning" not in done.stderr + resumed.stderr  # no deprecated SDK calls


@pytest.mark.parametrize("sdk", ["mint", "tinker"])
def test_sft_then_rl_is_one_command_and_resumes_on_either_generation(
    server: LocalServer, sdk: str, tmp_path: Path
) -> None:
    """``--objective sft ... --then rl``: the RL stage starts from the SFT stage's final
    state on the same server, in ``<run dir>/rl``; ``--resume RUN --then-steps 3`` then
    trains the RL stage's third step alone (engine/stages.py)."""
    python_of(sdk)
    run_dir = tmp_path / "run"
    sft = ("--objective", "sft", "--task", f"jsonl:{SFT_DATA}", "--steps", "2")
    then = ("--then", "rl", "--then-task", "arithmetic", "--then-steps", "2", "--then-batch", "2")
    done = engine_run(sdk, server, *sft, *then, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    first = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    second = json.loads((run_dir / "rl" / "config.json").read_text())
    assert second["model"]["init_from"] == first[-1]["state_path"]
    assert second["session"]["sdk"] == sdk and second["training"]["objective"] == "rl"
    assert steps_of(run_dir / "rl") == [1, 2]

    resumed = engine_run(sdk, server, "--resume", str(run_dir), "--then-steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert steps_of(run_dir / "rl") == [1, 2, 3]
    sft_steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert sft_steps == [1, 2]  # the finished SFT stage is not run again
    final = json.loads((run_dir / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert resumed.stdout.splitlines()[-1] == f"Saved: {final['sampler_path']}"


@pytest.mark.parametrize("sdk", ["mint", "tinker"])
def test_an_openai_sdk_agent_trains_on_either_generation(
    agent_server: LocalServer, sdk: str, tmp_path: Path
) -> None:
    """The shipped openai agent (examples/openai_calculator_agent.py) trains through the
    capturing endpoint with the engine on each SDK generation: every episode is the
    agent's calls as turns, each prompt built on the tokens sampled before it."""
    python_of(sdk)
    run_dir = tmp_path / "run"
    done = engine_run(
        sdk,
        agent_server,
        *("--task", "examples.openai_calculator_agent:task", "--max-tokens", "96"),
        *("--steps", "2", "--episode-timeout", "300", "--run-dir", str(run_dir)),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((run_dir / "config.json").read_text())["session"]["sdk"] == sdk
    assert steps_of(run_dir) == [1, 2]
    logged = [json.loads(line) for line in (run_dir / ROLLOUTS_FILE).read_text().splitlines()]
    episodes = [e for row in logged for e in row["episodes"]]
    assert episodes and all(e["outcome"] in ("done", "parse_error") for e in episodes)
    assert all(not turn["new_context"] for e in episodes for turn in e["turns"][1:])
    assert any(turn.get("logs", {}).get("tool_calls") for e in episodes for turn in e["turns"])


@pytest.mark.parametrize("sdk", ["mint", "tinker"])
def test_a_rejected_key_is_one_line(server: LocalServer, sdk: str, tmp_path: Path) -> None:
    done = engine_run(sdk, server, "--run-dir", str(tmp_path / "r"), key="tml-not-the-key")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: the MinT server at {server.base_url} rejected the API key (HTTP 401); "
        "check MINT_API_KEY"
    )


def test_gspo_trains_through_the_038_sdk(server: LocalServer, tmp_path: Path) -> None:
    """``--loss gspo`` (a loss only tinker >= 0.38 sends) trains end to end through the
    unmodified 0.38 SDK: the step's datums reach the server with their
    ``sequence_ratio_mask``, the loss comes back, and the Adam step moves the LoRA (its B
    matrices start at zero)."""
    run_dir = tmp_path / "r"
    # A step whose groups all have equal rewards sends no forward_backward: 8 groups of 6
    # at temperature 1 make sure the loss reaches the server.
    wide = ("--batch", "8", "--group", "6", "--temperature", "1.0")
    before = server.stats.applied
    done = engine_run(
        "tinker", server, *wide, "--loss", "gspo", "--steps", "1", "--run-dir", str(run_dir)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "config.json").read_text())["training"]["loss"] == "gspo"
    after = server.stats.applied
    assert after.get("forward_backward", 0) > before.get("forward_backward", 0)
    assert after.get("optim_step", 0) == before.get("optim_step", 0) + 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [row for row in rows if "avg_reward" in row]
    assert math.isfinite(step["optim/loss"])
    saved = done.stdout.splitlines()[-1].removeprefix("Saved: tinker://")
    adapter = load_file(server.data_dir / saved / "adapter.safetensors")
    assert any(bool(t.any()) for name, t in adapter.items() if "lora_B" in name)


@pytest.mark.parametrize("max_steps_off_policy", ["0", "1"])
def test_stable_reinforce_trains_through_the_038_sdk(
    server: LocalServer, tmp_path: Path, max_steps_off_policy: str
) -> None:
    """``--loss stable_reinforce``: the engine samples with ``record_stability_info``,
    attributes every datum to the sequences it sampled (``Datum.with_provenance``), and
    the server trains on its own records of them, on- and off-policy."""
    run_dir = tmp_path / "r"
    wide = ("--batch", "8", "--group", "6", "--temperature", "1.0")
    before = server.stats.applied
    done = engine_run(
        "tinker",
        server,
        *wide,
        "--loss",
        "stable_reinforce",
        "--max-steps-off-policy",
        max_steps_off_policy,
        "--steps",
        "2",
        "--run-dir",
        str(run_dir),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    after = server.stats.applied
    assert after.get("forward_backward", 0) > before.get("forward_backward", 0)
    assert after.get("optim_step", 0) == before.get("optim_step", 0) + 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "avg_reward" in row]
    assert len(steps) == 2 and all(math.isfinite(row["optim/loss"]) for row in steps)


def test_the_other_generation_is_refused_in_one_line(tmp_path: Path) -> None:
    """Asking the tinker 0.38 environment for the mint adapter: exit 2, one line, before
    a run dir exists."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    env.update(TINKER_API_KEY=KEY, TINKER_BASE_URL="http://127.0.0.1:9", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [
            str(tinker_python()),
            "-m",
            "engine.run",
            "--sdk",
            "mint",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "Error: --sdk mint is not installed (this environment has tinker 0.38.0; the two SDK "
        "generations cannot share an environment): pip install 'engine[mint]' (MinT: "
        "mindlab-toolkit on tinker 0.22)"
    )
    assert not (tmp_path / "r").exists()


CLASSIFY_038 = """
import json, httpx, tinker
from engine.errors import classify
from tinker.lib.retryable_exception import RetryableException
from tinker.types import RequestErrorCategory
req = httpx.Request("POST", "http://127.0.0.1:1/api/v1/forward_backward")
def status(code):
    answer = httpx.Response(code, json={"detail": "d"}, request=req)
    return tinker.APIStatusError("x", response=answer, body={"detail": "d"})
cases = {
    "429": status(429), "401": status(401), "402": status(402),
    "connection": tinker.APIConnectionError(request=req),
    "timeout": tinker.APITimeoutError(request=req),
    "expired": RetryableException("expired"),
    "user": tinker.RequestFailedError(
        "Request failed: bad", request_id="1", category=RequestErrorCategory.User
    ),
}
print(json.dumps({k: classify(v).transient for k, v in cases.items()}))
"""


def test_tinker_038_errors_are_classified_like_022(tmp_path: Path) -> None:
    """engine.errors under tinker 0.38: the same verdicts as under 0.22."""
    done = subprocess.run(
        [str(tinker_python()), "-c", CLASSIFY_038],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {
        "429": True,
        "401": False,
        "402": False,
        "connection": True,
        "timeout": True,
        "expired": True,
        "user": False,
    }
