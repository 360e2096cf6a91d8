"""``python -m engine.doctor URL`` against the local server on both SDK generations, and
a run that refuses before sampling when the server lacks what its settings need
(engine.session.capabilities: the same probes)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from engine.local import LocalServer
from tests.tinker_env import REPO, tinker_python

KEY = "tml-doctor-key"
TIMEOUT_S = 900  # a hang guard on a loaded 2-core machine; a probe run takes seconds
REFUSAL = "forward_backward is not offered by this proxy"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(api_key=KEY) as running:
        yield running


def command(python: Path, module: str, *args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    env.update(
        {
            "MINT_API_KEY": KEY,
            "MINT_BASE_URL": url,
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
        }
    )
    return subprocess.run(
        [str(python), "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=REPO,
    )


def statuses(stdout: str) -> dict[str, str]:
    report = json.loads(stdout)
    return {f["capability"]: f["status"] for f in report["findings"]}


@pytest.mark.slow  # the SDK matrix: CI runs it (-m slow)
@pytest.mark.parametrize("sdk", ["mint", "tinker"])
def test_the_doctor_reports_the_local_server_on_each_sdk(server: LocalServer, sdk: str) -> None:
    python = Path(sys.executable) if sdk == "mint" else tinker_python()
    done = command(python, "engine.doctor", server.base_url, "--json", url=server.base_url)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["sdk"] == sdk
    found = statuses(done.stdout)
    supported = [
        "auth",
        "models",
        "sdk and routes",
        "sample with logprobs",
        "prompt logprobs",
        "loss cross_entropy",
        "loss importance_sampling",
        "loss ppo",
        "loss config --loss-temperature sampling",
        "optim_step",
        "checkpoint with optimizer",
        "checkpoint ttl",
        "checkpoint upload",
        "sampling backpressure",
        "cleanup",
    ]
    assert {c: found[c] for c in supported} == dict.fromkeys(supported, "supported")
    # The mint SDK cannot send the tinker-only losses; tinker 0.38 can.
    expected = "skipped" if sdk == "mint" else "supported"
    assert found["loss stable_reinforce"] == expected
    assert set(found.values()) <= {"supported", "refused", "error", "skipped"}


@pytest.mark.slow
@pytest.mark.parametrize("service", ["mint", "tinker"])
@pytest.mark.parametrize("sdk", ["mint", "tinker"])
def test_the_doctor_reports_the_hosted_profiles_refusals(service: str, sdk: str) -> None:
    python = Path(sys.executable) if sdk == "mint" else tinker_python()
    with LocalServer(api_key=KEY, service=service) as hosted:
        done = command(python, "engine.doctor", hosted.base_url, "--json", url=hosted.base_url)
    assert done.returncode == 0, done.stderr
    found = statuses(done.stdout)
    assert found["loss ppo"] == found["checkpoint with optimizer"] == "supported"
    # A hosted service refuses the keys only the engine's local server takes.
    for flag in ("--tis-cap", "--mask-low --mask-high", "--loss-temperature sampling"):
        assert found[f"loss config {flag}"] == "refused"
    details = {f["capability"]: f["detail"] for f in json.loads(done.stdout)["findings"]}
    assert "'temperature'" in details["loss config --loss-temperature sampling"]


def test_the_table_is_one_aligned_line_per_capability(server: LocalServer) -> None:
    done = command(Path(sys.executable), "engine.doctor", server.base_url, url=server.base_url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"Capabilities of {server.base_url}:"
    rows = [line for line in lines[1:] if line.strip()]
    status_column = {line.index(" supported ") for line in rows if " supported " in line}
    assert len(status_column) == 1  # aligned
    assert any(line.split()[:3] == ["loss", "ppo", "supported"] for line in rows)


def test_bad_input_is_exit_2_and_no_server_is_exit_1(tmp_path: Path) -> None:
    python = Path(sys.executable)
    bad = command(python, "engine.doctor", "ftp://example", url="http://127.0.0.1:1")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    with socket_closed() as url:
        gone = command(python, "engine.doctor", url, url=url)
    assert gone.returncode == 1, gone.stderr
    assert gone.stderr.strip().splitlines() == [gone.stderr.strip()]
    assert "cannot reach" in gone.stderr


@contextmanager
def socket_closed() -> Iterator[str]:
    """A loopback URL nothing listens on."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()
    yield f"http://127.0.0.1:{port}"


@contextmanager
def refusing_proxy(upstream: str, refused: str) -> Iterator[tuple[str, list[str]]]:
    """A loopback proxy to ``upstream`` that answers 400 (category user) to
    ``/api/v1/<refused>``: a server with one capability removed. Yields its URL and
    the paths it forwarded or refused."""
    seen: list[str] = []
    client = httpx.Client(base_url=upstream, timeout=120.0)

    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(self.path)
            if self.path == f"/api/v1/{refused}":
                status = 400
                data = json.dumps({"error": REFUSAL, "category": "user"}).encode()
                headers = {"Content-Type": "application/json"}
            else:
                skip = {"host", "content-length", "connection"}
                sent = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                answer = client.request(self.command, self.path, content=body, headers=sent)
                status, data = answer.status_code, answer.content
                keep = ("content-type", "retry-after", "location")
                headers = {k: v for k, v in answer.headers.items() if k.lower() in keep}
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _forward

        def log_message(self, format: str, *args: object) -> None:
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}", seen
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()
        client.close()


RUN = ("--batch", "2", "--group", "2", "--max-tokens", "4", "--steps", "2", "--no-progress")


def test_a_run_refuses_before_sampling_when_the_server_refuses_its_loss(tmp_path: Path) -> None:
    # A hosted profile: the run checks what it needs (the local service takes everything
    # a run sends, so a run against it is not probed).
    with (
        LocalServer(api_key=KEY, service="mint") as hosted,
        refusing_proxy(hosted.base_url, "forward_backward") as (url, seen),
    ):
        doctor = command(Path(sys.executable), "engine.doctor", url, "--json", url=url)
        seen.clear()
        done = command(
            Path(sys.executable),
            "engine.run",
            *RUN,
            "--loss",
            "ppo",
            "--run-dir",
            str(tmp_path / "run"),
            url=url,
        )
    assert doctor.returncode == 0, doctor.stderr
    assert statuses(doctor.stdout)["loss ppo"] == "refused"
    assert REFUSAL in doctor.stdout
    # A refused call leaves the probes' training client usable (a fresh one): no later
    # probe waits on the refused call's place in its sequence.
    assert statuses(doctor.stdout)["sampler weights"] == "supported"
    assert done.returncode == 2, done.stdout + done.stderr
    error = done.stderr.strip().splitlines()
    assert len(error) == 1
    assert "cannot train with loss ppo" in error[0] and "--loss ppo" in error[0]
    assert REFUSAL in error[0]
    assert "Step 1" not in done.stdout
    # The check's own 2-token sample is the only one: the run sampled nothing.
    assert seen.count("/api/v1/asample") <= 1


def test_a_run_against_the_hosted_mint_profile_refuses_a_local_loss_option(
    tmp_path: Path,
) -> None:
    with LocalServer(api_key=KEY, service="mint") as hosted:
        done = command(
            Path(sys.executable),
            "engine.run",
            *RUN,
            "--loss-temperature",
            "sampling",
            "--run-dir",
            str(tmp_path / "run"),
            url=hosted.base_url,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    error = done.stderr.strip().splitlines()
    assert len(error) == 1 and "--loss-temperature sampling" in error[0]
    assert "'temperature'" in error[0]
    assert "Step 1" not in done.stdout
