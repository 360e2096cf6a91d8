"""How a run is isolated: the bubblewrap (``bwrap``) command line around the launcher,
whether bubblewrap can isolate on this machine, and the launcher that sets the limits.

Why bubblewrap: it is the small, well-kept setuid-free sandbox that Flatpak ships (a Debian
package), and it does in one exec what would otherwise be a hand-written sequence of
``unshare``/``mount``/``pivot_root`` calls: new pid, network, IPC, UTS and cgroup
namespaces, a root filesystem built from read-only binds, a private tmpfs, and the whole
tree killed with its pid namespace.

The launcher is a few lines of Python run inside the sandbox: it forks, and the child drops
to the code's user (as root: a random unused uid, so the process limit counts only this
run's processes: the kernel does not apply RLIMIT_NPROC to uid 0), sets the resource limits
and execs the command; the launcher waits and writes the exit status and CPU time to a pipe
the code cannot see.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import anyio.to_thread

__all__ = [
    "LAUNCHER",
    "PATH",
    "TMP",
    "bwrap_argv",
    "code_uid",
    "isolation_problem",
    "isolation_problem_now",
    "launcher_argv",
]

TMP = "/tmp"
"""The sandbox's private writable directory, its working directory too."""
PATH = "/usr/local/bin:/usr/bin:/bin"

LAUNCHER = """\
import json, os, resource, signal, sys
fd, uid, limits, argv = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4:]
os.set_inheritable(fd, False)
pid = os.fork()
if pid == 0:
    try:
        if uid >= 0:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them; exec would keep that
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        for name, pair in limits.items():
            resource.setrlimit(getattr(resource, name), tuple(pair))
        os.execvp(argv[0], argv)
    except BaseException as exc:
        os.write(2, ("sandbox: cannot start %s: %s\\n" % (argv[0], exc)).encode())
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
code = os.waitstatus_to_exitcode(status)
os.write(fd, json.dumps({"exit": code, "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
"""


def code_uid() -> int:
    """The uid isolated code runs as: a random unused one when this process is root (a
    fresh process count per run), else -1 (stay this user, in bubblewrap's user namespace)."""
    return 1_000_000 + secrets.randbelow(1 << 30) if os.geteuid() == 0 else -1


def launcher_argv(
    python: str,
    status_fd: int,
    uid: int,
    rlimits: Mapping[str, tuple[int, int]],
    argv: Sequence[str],
) -> list[str]:
    limits = json.dumps(rlimits)
    return [python, "-I", "-S", "-c", LAUNCHER, str(status_fd), str(uid), limits, *argv]


def _ancestors(path: Path) -> list[str]:
    return [str(p) for p in reversed(path.parents) if str(p) != "/"]


def bwrap_argv(
    bwrap: str,
    *,
    ro_paths: Sequence[Path],
    files: Mapping[str, int],
    tmp_bytes: int,
) -> list[str]:
    """bubblewrap's arguments up to ``--``: fresh namespaces (no network), ``/usr`` and
    ``ro_paths`` read-only, ``/proc``, a minimal ``/dev``, a private ``/tmp`` of
    ``tmp_bytes`` holding ``files`` (name -> readable fd), a ``/dev/shm`` of as much, and
    an empty environment."""
    args = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    if os.geteuid() == 0:
        # Privileged bubblewrap: root builds the mounts, the launcher switches user.
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        top = Path("/") / name
        if top.is_symlink():
            args += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            args += ["--ro-bind", str(top), str(top)]
    made: set[str] = set()
    for path in ro_paths:
        if path.is_relative_to("/usr"):
            continue
        for parent in _ancestors(path):
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", str(path), str(path)]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "0777", "--size", str(tmp_bytes), "--tmpfs", TMP]
    # POSIX semaphores and shared memory (multiprocessing) live in /dev/shm.
    args += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/dev/shm"]
    for name, fd in files.items():
        args += ["--perms", "0666", "--file", str(fd), f"{TMP}/{name}"]
    args += ["--clearenv", "--setenv", "PATH", PATH, "--setenv", "HOME", TMP]
    args += ["--setenv", "TMPDIR", TMP, "--setenv", "LANG", "C.UTF-8", "--chdir", TMP]
    return args


_probed: dict[str, str | None] = {}


def isolation_problem_now() -> str | None:
    """Why bubblewrap cannot isolate here (one sentence), or None when it can: it is
    installed and a trial sandbox runs (a few milliseconds). Probed once per process;
    this call waits for the probe (a task's loading does); :func:`isolation_problem`
    runs it off the event loop."""
    if "bwrap" not in _probed:
        _probed["bwrap"] = _probe()
    return _probed["bwrap"]


async def isolation_problem() -> str | None:
    """:func:`isolation_problem_now` from async code: the probe runs in a worker thread."""
    if "bwrap" in _probed:
        return _probed["bwrap"]
    return await anyio.to_thread.run_sync(isolation_problem_now)


def _probe() -> str | None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    argv = [*bwrap_argv(bwrap, ro_paths=[], files={}, tmp_bytes=1 << 20), "--", "true"]
    try:  # the timeout is a hang guard: a working bwrap answers in milliseconds
        done = subprocess.run(argv, capture_output=True, env={}, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap cannot create a sandbox here ({exc})"
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        why = said[-1] if said else f"exit {done.returncode}"
        return f"bubblewrap cannot create a sandbox here ({why})"
    return None
