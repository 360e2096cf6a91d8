"""engine.sandbox's API and CLI: results, limits checked when made, the refusal where it
cannot isolate (and the opt-out), bounded concurrency, cancellation killing the tree, and
the synchronous wrapper in a worker thread and a worker process."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_process
import anyio.to_thread
import pytest

import engine.sandbox.isolation as isolation
from benchmarks import sandbox as sandbox_benchmark
from engine.common import extras
from engine.envs.executors import ProcessWorkers
from engine.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    run_python_sync,
)
from engine.sandbox.__main__ import main as sandbox_main
from tests.sandbox_support import GUARD_S, new_token, processes_with, require_isolation, survivors

TESTS = Path(__file__).resolve().parent
DOCS = TESTS.parent / "docs" / "sandbox.md"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def isolated() -> Iterator[None]:
    require_isolation()
    yield


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A machine that cannot isolate, with neither bubblewrap nor ``unshare``: an empty
    PATH and a fresh probe."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(isolation, "_probed", {})


@pytest.mark.anyio
async def test_without_bubblewrap_the_namespaces_are_made_directly(
    isolated: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    unshare = shutil.which("unshare")
    if unshare is None or isolation.isolation_problem_now("unshare") is not None:
        pytest.skip("this machine cannot isolate with unshare")
    (tmp_path / "unshare").symlink_to(unshare)
    monkeypatch.setenv("PATH", str(tmp_path))  # unshare, and no bwrap
    monkeypatch.setattr(isolation, "_probed", {})
    code = "import os\nprint(open('data.txt').read(), sorted(os.environ), os.path.exists('/work'))"
    async with Sandbox(SandboxLimits(wall_s=60)) as sandbox:
        result = await sandbox.run_python(code, files={"data.txt": "42"})
    assert isolation.isolation_backend() == "unshare"
    assert "bubblewrap (bwrap) is not installed" in str(isolation._probed["bwrap"])
    assert result.ok and result.isolated, result
    assert result.stdout == "42 ['HOME', 'LANG', 'PATH', 'TMPDIR'] False\n"


@pytest.mark.anyio
async def test_a_run_gets_its_stdin_files_and_arguments_and_reports_its_exit(
    isolated: None,
) -> None:
    code = "import sys\nprint(sys.stdin.read().upper(), open('data.txt').read(), sys.argv[1:])\n"
    async with Sandbox(SandboxLimits(wall_s=60)) as sandbox:
        result = await sandbox.run_python(code, stdin="hello", files={"data.txt": "42"}, args=["a"])
        failed = await sandbox.run_python("import sys\nprint('bye', file=sys.stderr)\nsys.exit(3)")
        crashed = await sandbox.run_python(
            "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"
        )
    assert result.ok and result.stdout == "HELLO 42 ['a']\n" and result.isolated
    assert result.stdout_bytes == len(result.stdout) and result.cpu_s is not None
    assert (failed.exit_code, failed.stderr, failed.limit, failed.ok) == (3, "bye\n", None, False)
    assert failed.reason == "exit 3"
    assert crashed.exit_code is None and crashed.signal == "SIGSEGV" and crashed.limit is None
    assert json.loads(json.dumps(crashed.to_dict()))["reason"] == "signal SIGSEGV"


@pytest.mark.anyio
async def test_any_command_line_runs_with_the_limits(isolated: None) -> None:
    async with Sandbox(SandboxLimits(wall_s=60, file_bytes=4096)) as sandbox:
        result = await sandbox.run(["/bin/sh", "-c", "ulimit -f; echo $HOME; pwd"])
        missing = await sandbox.run(["/no/such/program"])
    assert result.ok and result.stdout.split() == ["8", "/tmp", "/tmp"], result
    assert missing.exit_code == 127 and "cannot start /no/such/program" in missing.stderr


@pytest.mark.anyio
async def test_multiprocessing_works_inside(isolated: None) -> None:
    code = (
        "import multiprocessing as mp\n"
        "if __name__ == '__main__':\n"
        "    with mp.Pool(2) as pool:\n"
        "        print(pool.map(abs, [-1, -2]))"
    )
    result = await Sandbox(SandboxLimits(wall_s=60)).run_python(code)
    assert result.ok and result.stdout == "[1, 2]\n", result


@pytest.mark.parametrize(
    "kwargs",
    [
        {"wall_s": 0},
        {"cpu_s": -1},
        {"memory_bytes": 1.5},
        {"processes": True},
        {"output_bytes": "1"},
    ],
)
def test_limits_are_checked_when_made(kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"sandbox limit {name} must be"):
        SandboxLimits(**kwargs)


@pytest.mark.parametrize("name", ["../up.txt", "/abs.txt", "dir/file.txt", ""])
@pytest.mark.anyio
async def test_file_names_stay_in_the_temp_dir(name: str) -> None:
    with pytest.raises(ValueError, match="plain names"):
        await Sandbox().run_python("pass", files={name: "x"})


def test_arguments_are_checked_when_the_sandbox_is_made(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_concurrent"):
        Sandbox(max_concurrent=-1)
    with pytest.raises(ValueError, match="existing absolute paths"):
        Sandbox(ro_paths=[tmp_path / "missing"])
    with pytest.raises(ValueError, match="existing absolute paths"):
        Sandbox(ro_paths=["relative"])


@pytest.mark.anyio
async def test_without_bubblewrap_it_refuses_in_one_line_unless_told_to_go_unisolated(
    no_bwrap: None,
) -> None:
    with pytest.raises(SandboxUnavailable) as refused:
        async with Sandbox():
            pass
    message = str(refused.value)
    assert "\n" not in message and "bubblewrap (bwrap) is not installed" in message
    assert "unshare is not installed" in message
    assert "allow_unisolated=True" in message
    with pytest.raises(SandboxUnavailable):
        await Sandbox().run_python("print('never')")
    result = await Sandbox(SandboxLimits(wall_s=60), allow_unisolated=True).run_python(
        "import os\nprint(sorted(os.environ))"
    )
    assert result.ok and not result.isolated
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR']\n"


def test_cli_prints_one_json_object_and_exits_0_whatever_the_code_did(
    isolated: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "boom.py"
    script.write_text("print('partial')\nraise SystemExit(5)\n")
    assert sandbox_main([str(script)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    outcome = json.loads(out)
    assert outcome["exit_code"] == 5 and outcome["limit"] is None
    assert outcome["stdout"] == "partial\n" and outcome["stdout_bytes"] == 8


def test_cli_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        sandbox_main([str(tmp_path / "missing.py")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No such file or directory" in err


def test_cli_refuses_in_one_line_without_isolation_and_runs_when_told(
    no_bwrap: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "hi.py"
    script.write_text("print('hi')\n")
    assert sandbox_main([str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "--unsafe-no-isolation" in captured.err
    assert sandbox_main(["--unsafe-no-isolation", str(script)]) == 0
    outcome = json.loads(capsys.readouterr().out)
    assert outcome["stdout"] == "hi\n" and outcome["isolated"] is False


@pytest.mark.anyio
async def test_at_most_max_concurrent_runs_at_once(
    isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox = Sandbox(SandboxLimits(wall_s=60), max_concurrent=2)
    real_run = sandbox._run
    running: list[int] = [0]
    peak: list[int] = [0]

    async def counted(*args: Any) -> SandboxResult:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        try:
            return await real_run(*args)
        finally:
            running[0] -= 1

    monkeypatch.setattr(sandbox, "_run", counted)
    results: list[SandboxResult] = []

    async def one() -> None:
        results.append(await sandbox.run_python("import time\ntime.sleep(0.2)"))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(one)
    assert len(results) == 5 and all(r.ok for r in results)
    assert peak[0] == 2


@pytest.mark.anyio
async def test_cancelling_a_run_kills_its_whole_tree(isolated: None) -> None:
    token = new_token()
    code = "import os, time\nos.fork()\ntime.sleep(600)"
    sandbox = Sandbox(SandboxLimits(wall_s=600))

    async def started() -> None:  # the code and its child are up (not just bubblewrap)
        while len([p for p in processes_with(token) if _runs_code(p)]) < 2:  # noqa: ASYNC110
            await anyio.sleep(0.05)

    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(sandbox.run_python, code, args=[token]))
            await started()
            tg.cancel_scope.cancel()
    assert await survivors(token) == []


def _runs_code(pid: int) -> bool:
    """Whether ``pid`` is ``python -I main.py ...`` (not bubblewrap or the launcher,
    whose command lines hold that too)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[1:3] == [b"-I", b"main.py"]


@pytest.mark.anyio
async def test_the_sync_wrapper_runs_in_a_worker_thread_and_a_worker_process(
    isolated: None,
) -> None:
    limits = SandboxLimits(wall_s=60)
    in_thread = await anyio.to_thread.run_sync(
        lambda: run_python_sync("print(6 * 7)", limits=limits)
    )
    in_process = await anyio.to_process.run_sync(_sync_in_worker, limits)
    assert in_thread.ok and in_thread.stdout == "42\n"
    assert in_process.ok and in_process.stdout == "42\n"


def _sync_in_worker(limits: SandboxLimits) -> SandboxResult:
    return run_python_sync("print(6 * 7)", limits=limits)


class CodeEnv:
    """An environment's shape: it holds a sandbox and runs code in a step."""

    def __init__(self) -> None:
        self.sandbox = Sandbox(SandboxLimits(wall_s=60), max_concurrent=1)

    async def step(self, code: str) -> tuple[str, int]:
        result = await self.sandbox.run_python(code)
        return result.stdout, os.getpid()


@pytest.mark.anyio
async def test_an_environment_holding_a_sandbox_steps_in_the_process_pool(
    isolated: None,
) -> None:
    async with ProcessWorkers(1) as workers:
        _, (stdout, pid) = await workers.call(CodeEnv(), "step", "print(5)")
    assert stdout == "5\n" and pid != os.getpid()


@pytest.mark.skipif(bool(extras.missing("ray")), reason="ray is not installed")
@pytest.mark.slow
@pytest.mark.anyio
async def test_an_environment_holding_a_sandbox_steps_on_ray(
    isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.envs.ray_workers import RayWorkers

    here = TESTS
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here), str(here.parent)]))
    async with RayWorkers(1) as workers:
        _, (stdout, pid) = await workers.call(CodeEnv(), "step", "print(5)")
    assert stdout == "5\n" and pid != os.getpid()


@pytest.mark.anyio
async def test_a_sandbox_pickles_for_worker_processes(isolated: None) -> None:
    sandbox = pickle.loads(pickle.dumps(Sandbox(SandboxLimits(wall_s=60), max_concurrent=3)))
    assert sandbox.max_concurrent == 3
    assert (await sandbox.run_python("print('again')")).stdout == "again\n"


UNPRIVILEGED_SCRIPT = r"""
import json, anyio
from engine.sandbox import SandboxLimits, Sandbox
FORKS = '''
import os, time
n = 0
while n < 100:
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
    except OSError:
        break
    n += 1
print(n)
'''
async def main():
    async with Sandbox(SandboxLimits(wall_s=60, processes=8)) as sandbox:
        forks = await sandbox.run_python(FORKS)
        env = await sandbox.run_python("import os\nprint(sorted(os.environ))")
    print(json.dumps({"forks": forks.stdout, "env": env.stdout, "isolated": env.isolated}))
anyio.run(main)
"""


def test_an_unprivileged_user_gets_the_same_isolation_and_process_limit(isolated: None) -> None:
    """Run as root (CI), the suite checks the root path (a random uid per run); this runs
    the sandbox as ``nobody`` (bubblewrap's user namespace, the process limit counted in
    it) with the system interpreter and this checkout's packages."""
    system_python = Path("/usr/bin/python3")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not system_python.exists():
        pytest.skip(
            "needs root, setpriv and /usr/bin/python3 (as another user every test does this)"
        )
    packages = sysconfig.get_paths()["purelib"]
    command = [
        "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
        "env", "-i", f"PYTHONPATH={TESTS.parent}{os.pathsep}{packages}", str(system_python),
    ]  # fmt: skip
    probe = subprocess.run(
        [*command, "-c", "import sys, engine.sandbox; print(tuple(sys.version_info[:2]))"],
        capture_output=True, text=True, timeout=GUARD_S, check=False,
    )  # fmt: skip
    if probe.stdout.strip() != str(tuple(sys.version_info[:2])):
        pytest.skip(
            f"nobody cannot import this checkout with {system_python}: {probe.stderr[-200:]}"
        )
    done = subprocess.run(
        [*command, "-c", UNPRIVILEGED_SCRIPT], capture_output=True, text=True, timeout=GUARD_S,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["isolated"] and outcome["env"] == "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']\n"
    assert 0 < int(outcome["forks"]) < 8


def test_the_documented_example_runs_as_written(isolated: None) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    example = next(b for b in blocks if "run_python(" in b)
    namespace: dict[str, Any] = {}
    exec(compile(example, str(DOCS), "exec"), namespace)
    result = anyio.run(namespace["main"])
    assert result.ok and result.stdout == "3\n"


def test_the_benchmark_writes_both_workloads_at_each_concurrency(
    isolated: None, tmp_path: Path
) -> None:
    assert sandbox_benchmark.main(["--runs", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sandbox.json").read_text())["rows"]
    assert {r["workload"] for r in rows} == set(sandbox_benchmark.WORKLOADS)
    for row in rows:
        assert row["bare"]["runs_per_s"] > 0 and row["sandbox"]["runs_per_s"] > 0
    table_lines = (tmp_path / "sandbox.md").read_text().count("\n| ")
    assert table_lines == len(rows) + 2  # the header, its rule, the rows
