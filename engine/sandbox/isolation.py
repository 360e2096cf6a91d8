"""How a run is isolated: the command line around the launcher (bubblewrap, else the
kernel's namespaces directly through util-linux ``unshare``), which of them works on this
machine, and the launcher that sets the limits.

Why bubblewrap first: it is the small, well-kept setuid-free sandbox that Flatpak ships (a
Debian package), and it does in one exec what would otherwise be a hand-written sequence of
``unshare``/``mount``/``pivot_root`` calls: new pid, network, IPC, UTS and cgroup
namespaces, a root filesystem built from read-only binds, a private tmpfs, and the whole
tree killed with its pid namespace.

Where bubblewrap is missing, that sequence is :data:`UNSHARE_SETUP`: util-linux's
``unshare`` (on every Linux system: no compiler, no new package) makes the pid, network,
IPC, UTS and mount namespaces (and a user namespace when this process is not root), and a
``sh`` script in them builds the same root (a tmpfs; ``/usr``, the top-level links and the
read-only paths bound read-only; a new ``/proc``, a few ``/dev`` nodes, the private
``/tmp`` holding the files), moves into it (``pivot_root``), detaches the host's root, and
execs the launcher with no new privileges, every capability but the two it needs to
switch user dropped, and an empty environment. Differences from bubblewrap: the
bound paths' own sub-mounts stay as the host has them, and there is no cgroup namespace.

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
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import anyio
import anyio.to_thread

__all__ = [
    "BACKENDS",
    "LAUNCHER",
    "PATH",
    "TMP",
    "UNSHARE_SETUP",
    "Backend",
    "bwrap_argv",
    "code_uid",
    "isolation_backend",
    "isolation_problem",
    "isolation_problem_now",
    "launcher_argv",
    "unshare_argv",
]

Backend = Literal["bwrap", "unshare"]
BACKENDS: tuple[Backend, ...] = ("bwrap", "unshare")
"""The ways to isolate, in the order they are tried."""

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
        os.closerange(3, 1 << 16)  # the code gets stdin, stdout and stderr, nothing more
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


UNSHARE_SETUP = """\
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
root=$1 size=$2
shift 2
ro_bind() {
    if [ -d "$1" ]; then mkdir -p "$root$1"; else mkdir -p "$root${1%/*}"; : >"$root$1"; fi
    mount --rbind "$1" "$root$1"
    mount -o remount,bind,ro "$root$1"
}
mount -t tmpfs -o size=1m,mode=0755 sandbox "$root"
ro_bind /usr
for top in bin sbin lib lib32 lib64; do
    if [ -L "/$top" ]; then ln -s "$(readlink "/$top")" "$root/$top"
    elif [ -d "/$top" ]; then ro_bind "/$top"; fi
done
n=$1
shift
while [ "$n" -gt 0 ]; do ro_bind "$1"; shift; n=$((n - 1)); done
mkdir "$root/proc" "$root/dev" "$root/tmp" "$root/.old"
mount -t proc proc "$root/proc"
mount -t tmpfs -o size=64k,mode=0755 dev "$root/dev"
for node in null zero full random urandom; do
    : >"$root/dev/$node"
    mount --bind "/dev/$node" "$root/dev/$node"
done
ln -s /proc/self/fd "$root/dev/fd"
mkdir -m 1777 "$root/dev/shm"
mount -t tmpfs -o "size=$size,mode=1777" shm "$root/dev/shm"
mount -t tmpfs -o "size=$size,mode=0777" tmp "$root/tmp"
n=$1
shift
while [ "$n" -gt 0 ]; do
    cat "/proc/self/fd/$2" >"$root/tmp/$1"
    chmod 0666 "$root/tmp/$1"
    shift 2
    n=$((n - 1))
done
cd "$root"
pivot_root . .old
umount -l /.old
rmdir /.old
mount -o remount,bind,ro /
cd /tmp
exec setpriv --no-new-privs --inh-caps=-all --bounding-set=-all,+setuid,+setgid \\
    env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp TMPDIR=/tmp LANG=C.UTF-8 "$@"
"""
"""Runs as pid 1 of the new namespaces: ``root tmp_bytes N ro_path... M name fd...
argv...``. It builds the root on ``root`` (an empty host directory, covered only in
this mount namespace), then execs ``argv``."""


def unshare_argv(
    unshare: str,
    *,
    root: Path,
    ro_paths: Sequence[Path],
    files: Mapping[str, int],
    tmp_bytes: int,
) -> list[str]:
    """``unshare``'s arguments up to the launcher (:data:`UNSHARE_SETUP`), the same
    sandbox as :func:`bwrap_argv`'s; ``root`` is an empty directory."""
    args = [unshare, "--pid", "--net", "--ipc", "--uts", "--mount", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        args += ["--user", "--map-root-user"]
    paths = [str(p) for p in ro_paths if not p.is_relative_to("/usr")]
    named = [x for name, fd in files.items() for x in (name, str(fd))]
    args += ["--", "/bin/sh", "-c", UNSHARE_SETUP, "sandbox", str(root), str(tmp_bytes)]
    return [*args, str(len(paths)), *paths, str(len(files)), *named]


_probed: dict[str, str | None] = {}


def isolation_problem_now(backend: Backend | None = None) -> str | None:
    """Why this machine cannot isolate (one sentence), or None when it can: bubblewrap
    or ``unshare`` (or only ``backend``) is installed and a trial sandbox runs (a few
    milliseconds). Probed once per process; this call waits for the probe (a task's
    loading does); :func:`isolation_problem` runs it off the event loop."""
    problems = [_problem(b) for b in ((backend,) if backend else BACKENDS)]
    if None in problems:
        return None
    return "; ".join(p for p in problems if p is not None)


def isolation_backend() -> Backend | None:
    """The first backend that isolates here (after :func:`isolation_problem_now`)."""
    return next((b for b in BACKENDS if _problem(b) is None), None)


async def isolation_problem(backend: Backend | None = None) -> str | None:
    """:func:`isolation_problem_now` from async code: the probe runs in a worker thread."""
    if all(b in _probed for b in ((backend,) if backend else BACKENDS)):
        return isolation_problem_now(backend)
    return await anyio.to_thread.run_sync(isolation_problem_now, backend)


def _problem(backend: Backend) -> str | None:
    if backend not in _probed:
        _probed[backend] = _probe_bwrap() if backend == "bwrap" else _probe_unshare()
    return _probed[backend]


def _trial(argv: list[str], name: str) -> str | None:
    try:  # the timeout is a hang guard: a working sandbox answers in milliseconds
        done = subprocess.run(argv, capture_output=True, env={}, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{name} cannot create a sandbox here ({exc})"
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        why = said[-1] if said else f"exit {done.returncode}"
        return f"{name} cannot create a sandbox here ({why})"
    return None


def _probe_bwrap() -> str | None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    argv = [*bwrap_argv(bwrap, ro_paths=[], files={}, tmp_bytes=1 << 20), "--", "true"]
    return _trial(argv, "bubblewrap")


def _probe_unshare() -> str | None:
    unshare = shutil.which("unshare")
    if unshare is None:
        return "util-linux's unshare is not installed"
    with tempfile.TemporaryDirectory(prefix="sandbox-root-") as root:
        args = unshare_argv(unshare, root=Path(root), ro_paths=[], files={}, tmp_bytes=1 << 20)
        return _trial([*args, "true"], "unshare")
