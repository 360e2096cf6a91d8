"""Where a Python process's CPU goes, thread by thread, without changing its code (Linux).

    python -m benchmarks.thread_profile --out prof.txt engine.run --steps 20 ...

runs the module like ``python -m`` and writes, at exit, the process's CPU seconds, each
thread's, and the functions they were in (inclusive and self). Every ``--interval``
seconds each thread's CPU ticks since the last look (``/proc/self/task/<tid>/stat``) are
charged to the Python stack it is in at that moment. cProfile sees only the thread that
enables it, and the SDK runs its HTTP client on a thread of its own. The sampler costs a
few percent of a core (it is listed as ``thread_profile``).
"""

from __future__ import annotations

import argparse
import atexit
import os
import runpy
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks(stat: str) -> int:
    """utime + stime of a ``/proc/.../stat`` line (fields 14 and 15)."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:  # the thread ended
        return None


class ThreadProfile:
    """Samples every thread of this process from a daemon thread of its own."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.threads: Counter[str] = Counter()
        self.inclusive: Counter[tuple[str, str]] = Counter()
        self.self_time: Counter[tuple[str, str]] = Counter()
        self._last: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread_profile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        frames = sys._current_frames()
        by_native = {t.native_id: t for t in threading.enumerate()}
        for entry in os.listdir("/proc/self/task"):
            tid = int(entry)
            stat = _read(f"/proc/self/task/{tid}/stat")
            if stat is None:
                continue
            ticks = cpu_ticks(stat)
            spent, self._last[tid] = ticks - self._last.get(tid, 0), ticks
            thread = by_native.get(tid)
            name = thread.name if thread is not None else "(native)"
            if spent <= 0:
                continue
            self.threads[name] += spent
            frame = frames.get(thread.ident) if thread is not None and thread.ident else None
            seen: set[str] = set()
            while frame is not None:
                code = frame.f_code
                where = f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_name}"
                if not seen:
                    self.self_time[name, where] += spent
                if where not in seen:
                    self.inclusive[name, where] += spent
                    seen.add(where)
                frame = frame.f_back

    def report(self, top: int = 60) -> str:
        stat = _read("/proc/self/stat")
        lines = [f"process cpu {cpu_ticks(stat) / CLOCK_TICKS:.2f}s" if stat else ""]
        lines += [f"thread {n}: {t / CLOCK_TICKS:.2f}s" for n, t in self.threads.most_common()]
        for title, counts in (("inclusive", self.inclusive), ("self", self.self_time)):
            lines.append(f"--- {title}")
            for (name, where), ticks in counts.most_common(top):
                lines.append(f"{ticks / CLOCK_TICKS:7.2f}s {name[:24]:24} {where}")
        return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.thread_profile", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="where the report is written")
    p.add_argument("--interval", type=float, default=0.01, help="seconds between samples")
    p.add_argument("module", help="the module to run, as python -m runs it")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(argv)
    profile = ThreadProfile(args.interval)

    def write() -> None:
        profile.stop()
        args.out.write_text(profile.report())

    exit_now = os._exit

    # engine.run leaves through os._exit when SDK threads linger, skipping atexit: only
    # one of the two ever writes
    def write_then_exit(status: int) -> NoReturn:
        write()
        exit_now(status)

    profile.start()
    atexit.register(write)
    os._exit = write_then_exit
    sys.argv = [args.module, *args.args]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
