"""PNG plots of the benchmark results (matplotlib's object API via engine.observe.plotting).

Three pictures: step time by configuration (throughput), the stage timeline (Gantt) of
a sequential and a pipelined run, and the client's CPU and memory against the batch
size (scaling). Each function takes plain data (what the JSON results hold) and a path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.observe.plotting import color, new_figure, save

__all__ = [
    "plot_episode_timeline",
    "plot_learning_curves",
    "plot_learning_grid",
    "plot_scaling",
    "plot_step_times",
    "plot_timeline",
]

STAGES = ("sample", "score", "train")


def plot_step_times(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Grouped bars: steady-state step time per configuration, one panel per latency
    profile, one group per workload; each bar is labelled with its speedup (the
    quickstart loop's step time / its step time). ``rows`` need ``profile``,
    ``workload``, ``config``, ``step_time_s`` and ``speedup``."""
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig = new_figure(6.5 * len(profiles), 4.5)
    axes = fig.subplots(1, len(profiles), squeeze=False)
    for ax, profile in zip(axes[0], profiles, strict=True):
        mine = [r for r in rows if r["profile"] == profile]
        workloads = list(dict.fromkeys(r["workload"] for r in mine))
        width = 0.8 / max(1, len(configs))
        for ci, config in enumerate(configs):
            xs, ys, labels = [], [], []
            for wi, workload in enumerate(workloads):
                row = next(
                    (r for r in mine if r["workload"] == workload and r["config"] == config), None
                )
                if row is None:
                    continue
                xs.append(wi + (ci - (len(configs) - 1) / 2) * width)
                ys.append(row["step_time_s"])
                labels.append(f"{row['speedup']:.1f}x" if row.get("speedup") else "")
            bars = ax.bar(xs, ys, width, label=config, color=color(ci))
            ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
        ax.set_xticks(range(len(workloads)), [f"{w}\n(batch x group x tokens)" for w in workloads])
        ax.set_ylabel("step time, s (median, steady state)")
        ax.set_title(f"latency profile: {profile}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Step time by configuration (labels: step-time speedup over the quickstart loop)")
    fig.tight_layout()
    return save(fig, path)


def plot_timeline(panels: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], path: Path) -> Path:
    """A Gantt chart per run: one lane per stage (sample, score, train), one bar per
    step's span in that stage, coloured and numbered by step. ``panels`` are
    ``(title, spans)`` with spans holding ``step``, ``stage``, ``start``, ``end``
    (seconds since the run's start); panels share the time axis."""
    fig = new_figure(11, 1.9 * len(panels) + 0.8)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)
    for ax, (title, spans) in zip(axes[:, 0], panels, strict=True):
        min_labelled = 0.015 * _extent(spans)
        for lane, stage in enumerate(STAGES):
            for span in (s for s in spans if s["stage"] == stage):
                width = max(span["end"] - span["start"], 1e-3)
                hue = color(span["step"] - 1)
                ax.broken_barh([(span["start"], width)], (lane - 0.4, 0.8), color=hue, alpha=0.85)
                if width > min_labelled:
                    ax.text(
                        span["start"] + width / 2,
                        lane,
                        str(span["step"]),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_yticks(range(len(STAGES)), STAGES)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the run started (bars numbered by step)")
    fig.tight_layout()
    return save(fig, path)


def plot_episode_timeline(panels: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> Path:
    """One lane per episode (by start), a bar from its start to its end coloured by the
    step that trained it, and each step's training as a shaded band numbered by step.
    ``panels`` are ``(title, timeline)`` with ``episodes`` ``[step, start, end]`` and
    ``train`` ``[step, start, end]`` (seconds); panels share the time axis."""
    fig = new_figure(11, 3.2 * len(panels) + 0.8)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)
    for ax, (title, data) in zip(axes[:, 0], panels, strict=True):
        for lane, (step, start, end) in enumerate(data["episodes"]):
            ax.broken_barh([(start, max(end - start, 1e-3))], (lane, 0.8), color=color(step - 1))
        for step, start, end in data["train"]:
            ax.axvspan(start, end, color=color(step - 1), alpha=0.25)
            ax.text(end, 0, f"train {step}", fontsize=7, rotation=90, va="bottom", ha="right")
        ax.set_ylabel("episodes")
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds (episodes coloured by the step that trained them)")
    fig.tight_layout()
    return save(fig, path)


def _extent(spans: Sequence[Mapping[str, Any]]) -> float:
    return max((s["end"] for s in spans), default=1.0) - min(
        (s["start"] for s in spans), default=0.0
    )


def plot_scaling(
    points: Sequence[Mapping[str, Any]],
    fits: Mapping[str, Mapping[str, float]],
    path: Path,
) -> Path:
    """Three panels against samples per step: client CPU per step with the fitted line
    ``fixed + marginal x samples`` (straight on log-log axes when the cost is linear),
    CPU per 1,000 samples, and peak memory growth. ``points`` need ``workload``,
    ``samples_per_step``, ``steps``, ``samples``, ``cpu_ms_per_step``,
    ``threads_ms_per_1k_samples`` (role -> ms) and ``rss_growth_mb``; ``fits`` is
    ``benchmarks.scaling.linear_fit``'s result."""
    pts = sorted(points, key=lambda p: p["samples_per_step"])
    xs = [p["samples_per_step"] for p in pts]
    fig = new_figure(16, 4.6)
    ax_step, ax_1k, ax_mem = fig.subplots(1, 3)
    series: dict[str, list[float]] = {"client": [p["cpu_ms_per_step"] for p in pts]}
    for role in ("main", "sdk", "workers"):
        series[role] = [
            p["threads_ms_per_1k_samples"].get(role, 0.0) * p["samples"] / 1000 / p["steps"]
            for p in pts
        ]
    names = {
        "client": "client total",
        "main": "engine event loop",
        "sdk": "SDK I/O thread",
        "workers": "scoring threads",
    }
    grid = [min(xs) * 0.8, max(xs) * 1.25]
    for i, (name, ys) in enumerate(series.items()):
        keep = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
        if not keep:
            continue
        ax_step.scatter(*zip(*keep, strict=True), color=color(i), label=names[name], s=22)
        fit = fits.get(name)
        if fit is not None:
            line = [
                fit["fixed_ms_per_step"] + fit["marginal_ms_per_1k_samples"] * x / 1000
                for x in grid
            ]
            if min(line) > 0:
                ax_step.plot(grid, line, "--", color=color(i), lw=1)
        per_1k = [(x, 1000 * y / x) for x, y in keep]
        ax_1k.scatter(*zip(*per_1k, strict=True), color=color(i), label=names[name], s=22)
    ax_step.set_title("Client CPU per step (dashed: linear fit)")
    ax_step.set_ylabel("CPU ms per step")
    ax_1k.set_title("Client CPU per 1,000 samples")
    ax_1k.set_ylabel("CPU ms per 1,000 samples")
    for ax in (ax_step, ax_1k):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("samples per step (problems x samples per problem)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ax_mem.scatter(xs, [p["rss_growth_mb"] for p in pts], color=color(0), s=22)
    for p in pts:
        ax_mem.annotate(
            p["workload"],
            (p["samples_per_step"], p["rss_growth_mb"]),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax_mem.set_xscale("log")
    ax_mem.set_xlabel("samples per step (problems x samples per problem)")
    ax_mem.set_ylabel("MB above the resident size at the run's start")
    ax_mem.set_title("Client peak memory growth")
    ax_mem.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return save(fig, path)


SERVER_LANES = ("server: sample", "server: train")


def plot_learning_curves(
    cells: Sequence[Mapping[str, Any]], path: Path, ylabel: str, latency: str | None = None
) -> Path:
    """Held-out reward of each grid cell against steps (left) and against wall-clock
    seconds (right), one row per env: the mean over its seeds with a band of one standard
    error, one colour per config, one line style per K, K=0's final mean dotted. ``cells``
    need ``env``, ``config``, ``k``, ``cell``, ``seeds``, ``target`` and ``curve`` (points
    with ``step``, ``reward_mean``, ``reward_se`` (None: no band) and ``wall_s``)."""
    envs = list(dict.fromkeys(c["env"] for c in cells))
    configs = list(dict.fromkeys(c["config"] for c in cells))
    ks = sorted({c["k"] for c in cells})
    styles = ("-", "--", "-.", ":")
    fig = new_figure(12, 4.2 * len(envs))
    axes = fig.subplots(len(envs), 2, squeeze=False)
    for row, env in zip(axes, envs, strict=True):
        ax_step, ax_time = row
        for c in (c for c in cells if c["env"] == env):
            style = {
                "color": color(configs.index(c["config"])),
                "ls": styles[ks.index(c["k"]) % len(styles)],
            }
            mean = [p["reward_mean"] for p in c["curve"]]
            se = [p["reward_se"] or 0.0 for p in c["curve"]]
            low = [m - s for m, s in zip(mean, se, strict=True)]
            high = [m + s for m, s in zip(mean, se, strict=True)]
            for ax, xs in (
                (ax_step, [p["step"] for p in c["curve"]]),
                (ax_time, [p["wall_s"] for p in c["curve"]]),
            ):
                ax.plot(
                    xs, mean, label=f"{c['cell']} (n={len(c['seeds'])})", marker="o", ms=3, **style
                )
                ax.fill_between(xs, low, high, color=style["color"], alpha=0.1)
        targets = {c["target"] for c in cells if c["env"] == env and c["target"] is not None}
        for ax in row:
            for target in targets:
                ax.axhline(target, color="0.4", lw=0.8, ls=":")
            ax.grid(alpha=0.3)
        ax_step.set_xlabel("training step")
        ax_step.set_ylabel(f"{ylabel}\n(mean ± SE over seeds)")
        ax_step.set_title(f"{env}: against steps")
        ax_time.set_xlabel(
            f"wall-clock s from the engine's start (median over seeds; latency {latency or 'off'})"
        )
        ax_time.set_title(f"{env}: against wall-clock (dotted: K=0's final mean)")
        ax_time.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return save(fig, path)


def plot_cycles(run: Mapping[str, Any], path: Path) -> Path:
    """One run per clock cycle: what the server's compute thread did (sampling; the
    training calls and snapshots) under its cycle starts (dotted lines), and what the
    client waited on (its sample / score / train spans, bars numbered by step; a step's
    train span runs from its first submission to its result). ``run`` is a throughput
    run as ``RunRecord.to_json(spans=True)`` writes it."""
    spans = run["spans"]
    timeline = run.get("server_timeline", {})
    lanes = (*STAGES, *SERVER_LANES)
    fig = new_figure(12, 3.6)
    ax = fig.subplots(1, 1)
    for lane, stage in enumerate(STAGES):
        for span in (s for s in spans if s["stage"] == stage):
            width = max(span["end"] - span["start"], 1e-3)
            ax.broken_barh(
                [(span["start"], width)], (lane - 0.4, 0.8), color=color(span["step"] - 1)
            )
            ax.text(
                span["start"] + width / 2,
                lane,
                str(span["step"]),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    for label, start, end in timeline.get("compute", []):
        lane = len(STAGES) + (0 if label == "asample" else 1)
        ax.broken_barh([(start, max(end - start, 1e-3))], (lane - 0.4, 0.8), color="0.35")
    for tick in timeline.get("cycle_starts", []):
        ax.axvline(tick, color="0.6", lw=0.6, ls=":")
    summary = run["summary"]
    cycles = summary.get("cycles_per_step")
    pace = f"pace {summary['step_time_s']:.2f} s/step" + (
        f" = {cycles:.2f} cycles/step" if cycles is not None else ""
    )
    ax.set_title(
        f"{run['label']} ({run['profile']}, {run['workload']}): {pace}; dotted: cycle starts",
        fontsize=10,
        loc="left",
    )
    ax.set_yticks(range(len(lanes)), [f"client: {s}" for s in STAGES] + list(SERVER_LANES))
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    ax.grid(axis="x", alpha=0.2)
    fig.tight_layout()
    return save(fig, path)


_K_STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)))


def plot_learning_grid(
    summary: Sequence[Mapping[str, Any]], path: Path, latency: str | None = None
) -> Path:
    """Held-out accuracy of each cell (``correction@K``) against steps and against
    wall-clock seconds: the mean over its seeds with a band of one standard error, one
    colour per correction, one line style per K, the K=0 baseline's final mean dotted.
    ``summary`` is ``benchmarks.learning_grid.summarize``'s result."""
    fig = new_figure(14, 5.2)
    ax_step, ax_time = fig.subplots(1, 2, sharey=True)
    corrections = list(dict.fromkeys(c["cell"].partition("@")[0] for c in summary))
    ks = sorted({c["max_steps_off_policy"] for c in summary})
    for c in summary:
        correction = c["cell"].partition("@")[0]
        style = {
            "color": color(corrections.index(correction)),
            "ls": _K_STYLES[ks.index(c["max_steps_off_policy"]) % len(_K_STYLES)],
            "lw": 1.4,
        }
        mean = [p["exact_mean"] for p in c["curve"]]
        low = [p["exact_mean"] - p["exact_se"] for p in c["curve"]]
        high = [p["exact_mean"] + p["exact_se"] for p in c["curve"]]
        label = f"{c['cell']} (n={len(c['seeds'])})"
        for ax, xs in (
            (ax_step, [p["step"] for p in c["curve"]]),
            (ax_time, [p["wall_s_mean"] for p in c["curve"]]),
        ):
            ax.plot(xs, mean, label=label, marker="o", ms=3, **style)
            ax.fill_between(xs, low, high, color=style["color"], alpha=0.08)
    target = next((c.get("target") for c in summary if c.get("target") is not None), None)
    for ax in (ax_step, ax_time):
        if target is not None:
            ax.axhline(target, color="0.4", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    ax_step.set_xlabel("training step")
    ax_step.set_ylabel("held-out greedy exact rate (mean ± SE over seeds)")
    ax_step.set_title("against steps")
    ax_time.set_xlabel(f"wall-clock seconds (mean over seeds; latency {latency or 'off'})")
    ax_time.set_title("against wall-clock time (dotted: K=0's final mean)")
    ax_time.legend(fontsize=7, ncol=2, loc="lower right")
    fig.suptitle("Learning grid: colour = correction, line style = K")
    fig.tight_layout()
    return save(fig, path)
