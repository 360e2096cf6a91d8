"""The per-thread CPU profiler: CPU ticks are charged to the thread that spent them and
to the functions on its stack."""

from __future__ import annotations

import threading

from benchmarks.thread_profile import ThreadProfile, cpu_ticks


def test_cpu_ticks_reads_utime_and_stime_after_any_thread_name() -> None:
    fields = ["S"] + ["0"] * 10 + ["7", "5"] + ["0"] * 30
    assert cpu_ticks("42 (odd) name) " + " ".join(fields)) == 12


def test_cpu_is_charged_to_the_thread_and_the_function_that_spent_it() -> None:
    profile = ThreadProfile()
    done = threading.Event()

    def spin_in_a_named_function() -> None:
        while not done.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin_in_a_named_function, name="spinner")
    spinner.start()
    try:
        while profile.threads["spinner"] < 3:
            profile.sample()
    finally:
        done.set()
        spinner.join()
    assert any(
        name == "spinner" and where.endswith(":spin_in_a_named_function")
        for name, where in profile.inclusive
    )
    assert "thread spinner:" in profile.report()
