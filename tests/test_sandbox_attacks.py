"""Attacks on engine.sandbox: each is contained, the result names the limit or the code
saw a refusal, nothing it started outlives the run, and the same sandbox runs the next
code normally; each with either backend (bubblewrap, and the namespaces made directly by
``unshare``) where this machine has it. SandboxLimits are small so the file stays fast;
time limits that are expected to stop the code are short, the others generous."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from engine.sandbox import Sandbox, SandboxLimits, SandboxResult
from engine.sandbox.isolation import BACKENDS, Backend
from tests.sandbox_support import new_token, require_isolation, survivors, use_backend

pytestmark = pytest.mark.anyio

CHECKOUT_FILE = Path(__file__).resolve().parents[1] / "pyproject.toml"
ROOMY = SandboxLimits(wall_s=60, cpu_s=30, memory_bytes=256 << 20, processes=32)
"""Limits none of these attacks should reach unless they aim at that one."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True, params=BACKENDS)
def _isolation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    require_isolation()
    backend: Backend = request.param
    use_backend(backend, monkeypatch)
    yield


async def contained(sandbox: Sandbox, result: SandboxResult, token: str) -> None:
    """Nothing with ``token`` survives and the sandbox still runs code."""
    assert await survivors(token) == [], f"processes outlived the run: {result}"
    after = await sandbox.run_python("print('still here')")
    assert after.ok and after.stdout == "still here\n", after


async def test_fork_bomb_is_capped_by_the_process_limit_and_dies_with_the_run() -> None:
    token = new_token()
    sandbox = Sandbox(SandboxLimits(wall_s=2, cpu_s=30, processes=16))
    code = """
import os
forked = failed = 0
while True:
    try:
        os.fork()
        forked += 1
    except OSError:
        failed += 1
"""
    result = await sandbox.run_python(code, args=[token])
    assert result.limit in ("wall", "cpu"), result
    await contained(sandbox, result, token)


async def test_memory_bomb_fails_its_allocation_and_names_memory() -> None:
    sandbox = Sandbox(SandboxLimits(wall_s=60, cpu_s=30, memory_bytes=128 << 20))
    result = await sandbox.run_python("hog = [bytearray(16 << 20) for _ in range(64)]")
    assert result.limit == "memory" and result.exit_code == 1, result
    await contained(sandbox, result, new_token())


async def test_cpu_spin_is_stopped_by_the_cpu_limit() -> None:
    token = new_token()
    sandbox = Sandbox(SandboxLimits(wall_s=60, cpu_s=1))
    result = await sandbox.run_python("while True:\n    pass", args=[token])
    assert result.limit == "cpu" and result.signal in ("SIGXCPU", "SIGKILL"), result
    assert result.cpu_s is not None and result.cpu_s > 0.5
    await contained(sandbox, result, token)


async def test_sleeping_past_the_deadline_is_killed_at_the_wall_clock_limit() -> None:
    token = new_token()
    sandbox = Sandbox(SandboxLimits(wall_s=1))
    result = await sandbox.run_python("import time\ntime.sleep(600)", args=[token])
    assert result.limit == "wall" and result.signal == "SIGKILL", result
    assert result.wall_s < 60
    await contained(sandbox, result, token)


async def test_a_process_that_ignores_sigterm_is_still_killed_with_its_children() -> None:
    token = new_token()
    sandbox = Sandbox(SandboxLimits(wall_s=1))
    code = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.fork()
time.sleep(600)
"""
    result = await sandbox.run_python(code, args=[token])
    assert result.limit == "wall", result
    await contained(sandbox, result, token)


async def test_no_network_not_even_a_listener_on_the_hosts_loopback() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"""
import os
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=5)
    print("connected")
except OSError as exc:
    print("refused", type(exc).__name__)
"""
        result = await Sandbox(ROOMY).run_python(code)
        assert result.ok and result.stdout.startswith("refused"), result
        with pytest.raises(BlockingIOError):
            listener.accept()


async def test_writes_outside_the_temp_dir_fail_and_reach_nothing_on_the_host(
    tmp_path: Path,
) -> None:
    target = tmp_path / "escaped.txt"
    places = ["/escaped.txt", "/usr/escaped.txt", "/proc/escaped.txt", str(target)]
    code = f"""
for place in {places!r}:
    try:
        with open(place, "w") as f:
            f.write("out")
        print("wrote", place)
    except OSError as exc:
        print("denied", place, type(exc).__name__)
with open("/tmp/inside.txt", "w") as f:
    f.write("fine")
print("tmp ok")
"""
    result = await Sandbox(ROOMY).run_python(code)
    assert result.ok, result
    assert "wrote" not in result.stdout and result.stdout.count("denied") == len(places)
    assert "tmp ok" in result.stdout
    assert not target.exists()


async def test_the_hosts_files_and_environment_are_invisible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sk-sandbox-test-" + new_token()
    monkeypatch.setenv("ENGINE_SANDBOX_TEST_KEY", secret)
    (tmp_path / "key.txt").write_text(secret)
    paths = [str(tmp_path / "key.txt"), str(CHECKOUT_FILE), "/root/.bashrc", "/etc/passwd"]
    code = f"""
import os
print(sorted(os.environ.items()))
for path in {paths!r} + ["/proc/1/environ", "/proc/self/environ"]:
    try:
        with open(path, "rb") as f:
            print(path, f.read())
    except OSError as exc:
        print("denied", path, type(exc).__name__)
"""
    result = await Sandbox(ROOMY).run_python(code)
    assert result.ok, result
    assert secret not in result.stdout and "ENGINE_SANDBOX_TEST_KEY" not in result.stdout
    for path in paths:
        assert f"denied {path}" in result.stdout, result.stdout


async def test_symlinks_and_proc_lead_nowhere_outside(tmp_path: Path) -> None:
    (tmp_path / "key.txt").write_text("host secret")
    host = [str(tmp_path / "key.txt"), str(CHECKOUT_FILE)]
    code = f"""
import os
os.symlink({host[0]!r}, "/tmp/link")
tries = ["/tmp/link", "/proc/1/root" + {host[1]!r}, "/proc/self/root" + {host[1]!r},
         "/proc/1/cwd/" + "pyproject.toml"]
for path in tries:
    try:
        with open(path) as f:
            print("read", path, f.read()[:20])
    except OSError as exc:
        print("denied", path, type(exc).__name__)
print("pids", len([p for p in os.listdir("/proc") if p.isdigit()]))
"""
    result = await Sandbox(ROOMY).run_python(code)
    assert result.ok, result
    assert "read" not in result.stdout and "host secret" not in result.stdout
    pids = int(result.stdout.rsplit("pids ", 1)[1])
    assert pids <= 4, f"the sandbox sees the host's processes: {result.stdout}"


async def test_signals_reach_no_process_outside() -> None:
    # a host process the code could aim at, and this test's own
    async with await anyio.open_process(["sleep", "600"]) as bystander:
        code = f"""
import os, signal
for pid in (-1, 1, {os.getpid()}, {bystander.pid}):
    try:
        os.kill(pid, signal.SIGKILL)
        print("sent", pid)
    except OSError as exc:
        print("denied", pid, type(exc).__name__)
"""
        result = await Sandbox(ROOMY).run_python(code)
        stat = await anyio.Path(f"/proc/{bystander.pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        assert state != "Z", "the code killed a host process"
        bystander.kill()
    # kill(-1) may end the code itself: what matters is that everything outside lives.
    assert result.limit is None, result


async def test_huge_output_is_cut_at_the_output_limit() -> None:
    token = new_token()
    sandbox = Sandbox(SandboxLimits(wall_s=60, output_bytes=64 << 10))
    result = await sandbox.run_python(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", args=[token]
    )
    assert result.limit == "output" and result.truncated, result.reason
    assert len(result.stdout) + len(result.stderr) <= 64 << 10
    assert result.stdout_bytes > 64 << 10
    await contained(sandbox, result, token)


async def test_orphaned_and_daemonised_children_do_not_outlive_the_run() -> None:
    token = new_token()
    sandbox = Sandbox(ROOMY)
    code = """
import os, time
ready_r, ready_w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(ready_w, b"up")
        time.sleep(600)
    os._exit(0)
if os.fork() == 0:
    time.sleep(600)
os.read(ready_r, 2)
print("parent leaves")
"""
    result = await sandbox.run_python(code, args=[token])
    assert result.ok and result.stdout == "parent leaves\n", result
    await contained(sandbox, result, token)


async def test_a_file_past_the_file_size_limit_is_stopped() -> None:
    sandbox = Sandbox(SandboxLimits(wall_s=60, file_bytes=1 << 20))
    result = await sandbox.run_python(
        "with open('/tmp/big', 'wb') as f:\n    f.write(b'x' * (4 << 20))"
    )
    assert result.limit == "file_size" and "File too large" in result.stderr, result
    shell = await sandbox.run(["/bin/sh", "-c", "exec head -c 4194304 /dev/zero > /tmp/big"])
    assert shell.limit == "file_size" and shell.signal == "SIGXFSZ", shell
