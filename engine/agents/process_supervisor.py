"""The supervisor of one agent process: ``python -I -S process_supervisor.py ARGV...`` runs ``ARGV``
and, however it ends, ends every process it started (stdlib only: it starts fast).

On Linux it is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a descendant whose parent
dies -- one that called ``setsid`` or double-forked included -- is re-parented to it, so
the whole tree stays reachable. The tree ends when the agent exits, when the supervisor
is sent SIGTERM, SIGINT or SIGHUP, when its parent dies (``PR_SET_PDEATHSIG``) and when
its stdin, a pipe from the engine that nothing is written to (the lifeline), reaches EOF:
an engine that is SIGKILLed or OOM-killed closes it. Ending it is SIGKILL to each child
until no child is left (each kill re-parents that child's children here). The
supervisor then exits as the agent did (its status, or the same signal).

Elsewhere (no ``prctl``, no ``/proc``) it ends the agent only, and the engine then
kills the process group they share: a descendant that left it (``setsid``) is not
tracked there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str]) -> int:
    tracked = _prctl(_PR_SET_CHILD_SUBREAPER, 1) and os.path.exists("/proc/self/stat")
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    for signum in (*_STOP, signal.SIGCHLD):
        signal.signal(signum, lambda *_: None)  # (each wakes the loop below)
    try:  # (stdin /dev/null: the lifeline stays here)
        stdin = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
        agent = os.posix_spawnp(argv[0], argv, os.environ, file_actions=stdin)
    except OSError as exc:
        print(f"the agent process cannot start: {exc}", file=sys.stderr)
        return 127
    status = _watch(agent, wake_read)
    _end_tree(agent, tracked)
    if status is None:
        return 128 + signal.SIGTERM
    if os.WIFSIGNALED(status):  # (the same signal: SIGKILL cannot be reset, nor needs it)
        with contextlib.suppress(OSError):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    return os.waitstatus_to_exitcode(status)


def _watch(agent: int, wake: int) -> int | None:
    """Wait for the agent's exit (its wait status), or a stop (None)."""
    poll = select.poll()
    poll.register(0, select.POLLIN)
    poll.register(wake, select.POLLIN)
    while True:
        for fd, _ in poll.poll():
            if fd == 0 and not os.read(0, 4096):
                return None  # the lifeline: the engine is gone or ends the episode
            if fd == wake and set(os.read(wake, 4096)) & set(_STOP):
                return None
        with contextlib.suppress(ChildProcessError):
            while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
                if reaped[0] == agent:
                    return reaped[1]


def _end_tree(agent: int, tracked: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(agent, signal.SIGKILL)
    while True:
        for pid in _children() if tracked else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _children() -> list[int]:
    """This process's children (from /proc)."""
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                with open(os.path.join(entry.path, "stat")) as file:
                    stat = file.read()
                if int(stat.rpartition(")")[2].split()[1]) == me:
                    found.append(int(entry.name))
    return found


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` where the C library has it; False where it has not."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
