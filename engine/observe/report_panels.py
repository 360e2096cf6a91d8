"""The panels of the run report (:mod:`engine.observe.run_report`), chosen from the metrics the runs
logged: each panel is built as data first (:class:`Panel`) and drawn only when it holds a
value, so a task gets the panels of what it measures and never an empty one.

The metrics are recognised by the engine's names (docs/run-directory.md): a reward
component ``c`` is ``env/all/<c>`` with its ``env/all/<c>/rate``; an environment's
per-episode counts are the other ``env/all/*`` means (turns, tool calls, tool errors,
the environment's own turn metrics); ``env/all/outcome/*`` are the episode endings;
``eval/*`` come from ``eval.jsonl``; an objective's own signals are ``sft/*``
(supervised fine-tuning), ``distill/*`` (distillation) and ``dpo/*`` (preference pairs).
A run that samples nothing (no ``time/sample``: SFT) gets no staleness or ``loss:sum``
panel, and its throughput in tokens. Choosing needs nothing; :func:`draw_panels`
imports matplotlib (call it after ``require("report", ...)``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from engine.objectives.dpo import HELD_OUT_ACCURACY
from engine.observe.tokens import COST_CUMULATIVE, CUMULATIVE, KINDS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from engine.observe.run_data import RunData

__all__ = ["Panel", "build_panels", "components", "draw_panels"]

COLUMNS = 3
STYLES = (  # (line style, marker): one per metric of a panel, in order
    ("-", ""),
    ("--", ""),
    (":", ""),
    ("-.", ""),
    ("-", "s"),
    ("--", "^"),
    (":", "D"),
    ("-.", "v"),
)
STAGES: dict[str, str] = {  # time/<stage> metric -> bar label
    "sample": "sample",
    "score": "score",
    "train": "train",
    "wait": "trainer\nwaits",
    "step": "whole\nstep",
}
# env/all/* means that are not per-episode counts (they have panels of their own or none)
_NOT_COUNTS = frozenset(
    {
        "episodes",
        "reward/total",
        "by_group/frac_mixed",
        "tokens_per_episode",
        "ac_tokens_per_turn",
        "ob_tokens_per_turn",
        "truncated_rate",
        "masked_rate",
    }
)
_ENDINGS = {
    "env/all/truncated_rate": "turns cut at max tokens, % of turns",
    "env/all/masked_rate": "masked (left out of training)",
}
_FIRST_COUNTS = ("turns_per_episode", "tool_calls", "tool_errors", "parse_errors")
_FRACTIONS = (
    ("groups/trained_frac", "trained groups"),
    ("response_len/truncated_frac", "truncated responses"),
    ("response_len/empty_frac", "empty responses"),
)
_SAME = 1e-9


@dataclass(frozen=True)
class Curve:
    """One line of a panel: one metric of one run."""

    run: int
    what: str
    """The metric's label in the legend ("" for a panel of one metric: the run's label)."""
    xs: Sequence[float]
    ys: Sequence[float | None]
    style: int = 0
    """Index into :data:`STYLES`."""
    smoothed: bool = False
    """Drawn faint (raw) and bold (smoothed), like the reward."""
    steps: bool = False
    """Drawn as a staircase (integer values such as staleness)."""
    markers: bool = False

    @property
    def has_value(self) -> bool:
        return any(y is not None for y in self.ys)


@dataclass(frozen=True)
class Bars:
    """One run's bars: a value per category."""

    run: int
    values: Sequence[float]


@dataclass(frozen=True)
class Panel:
    key: str
    """A stable name, set as the axes' gid (what tests and readers look for)."""
    title: str
    curves: Sequence[Curve] = ()
    percent: bool = False
    """Values are fractions, drawn as % from 0 to 100."""
    xlabel: str = "step"
    bars: Sequence[Bars] = ()
    categories: Sequence[str] = ()

    @property
    def has_value(self) -> bool:
        return any(c.has_value for c in self.curves) or any(any(b.values) for b in self.bars)


def _curves(
    runs: Sequence[RunData],
    names: Sequence[tuple[str, str]],
    *,
    first_style: int = 0,
    percent: bool = False,
    **kind: bool,
) -> list[Curve]:
    """One curve per (metric, label) of ``names`` that a run logged, in the style of its
    position (a metric "" keeps a position and draws nothing)."""
    scale = 100.0 if percent else 1.0
    return [
        Curve(
            i,
            what,
            [float(s) for s in run.series(name)[0]],
            [None if v is None else v * scale for v in run.series(name)[1]],
            (first_style + j) % len(STYLES),
            **kind,
        )
        for i, run in enumerate(runs)
        for j, (name, what) in enumerate(names)
        if name and run.has(name)
    ]


def _keys(records: Sequence[dict[str, Any]]) -> set[str]:
    return {k for record in records for k in record}


def _step_keys(runs: Sequence[RunData]) -> set[str]:
    return {k for run in runs for k in _keys(run.steps)}


def components(runs: Sequence[RunData]) -> list[str]:
    """The reward components the runs' steps logged (``env/all/<c>`` with a rate)."""
    keys = _step_keys(runs)
    return sorted(
        k.removeprefix("env/all/").removesuffix("/rate")
        for k in keys
        if k.startswith("env/all/") and k.endswith("/rate") and k.removesuffix("/rate") in keys
    )


def _same(records: Sequence[dict[str, Any]], a: str, b: str) -> bool:
    """Whether metrics ``a`` and ``b`` are equal wherever both are numbers."""
    pairs = [(m.get(a), m.get(b)) for m in records]
    return all(
        abs(x - y) <= _SAME
        for x, y in pairs
        if isinstance(x, int | float) and isinstance(y, int | float)
    )


def same_as_reward(runs: Sequence[RunData], component: str) -> bool:
    """Whether a component is the whole reward, step by step and held out (a dataset
    task's ``correct``): the reward's panels show it, under its name."""
    return all(
        _same(run.steps, f"env/all/{component}", "avg_reward")
        and _same(run.evals, f"eval/{component}", "eval/reward/total")
        for run in runs
    )


def shaped(runs: Sequence[RunData], component: str) -> bool:
    """Whether a component's rate (fraction > 0) tells more than its mean: not a 0/1 score."""
    return not all(
        _same(run.steps, f"env/all/{component}", f"env/all/{component}/rate") for run in runs
    )


def episode_counts(runs: Sequence[RunData]) -> list[str]:
    """The per-episode means of an environment: turns, tool calls, tool and parse
    errors first, then the environment's own turn metrics."""
    taken = {f"env/all/{c}" for c in components(runs)} | {f"env/all/{n}" for n in _NOT_COUNTS}
    counts = [
        k
        for k in _step_keys(runs)
        if k.startswith("env/all/")
        and k not in taken
        and not k.endswith("/rate")
        and not k.startswith("env/all/outcome/")
    ]
    first = [f"env/all/{n}" for n in _FIRST_COUNTS]
    return [k for k in first if k in counts] + sorted(k for k in counts if k not in first)


def endings(runs: Sequence[RunData]) -> list[str]:
    """The episode endings any step saw (outcomes, truncated and masked episodes > 0)."""
    keys = _step_keys(runs)
    candidates = sorted(k for k in keys if k.startswith("env/all/outcome/"))
    candidates += [k for k in ("env/all/truncated_rate", "env/all/masked_rate") if k in keys]
    return [k for k in candidates if any((v or 0) > 0 for run in runs for v in run.series(k)[1])]


def wall_clock(run: RunData) -> list[float] | None:
    """Seconds from the end of the run's first step to the end of each step (from each
    step's ``time``); None when a step lacks a readable time."""
    try:
        times = [datetime.fromisoformat(str(m["time"])).timestamp() for m in run.steps]
    except (KeyError, ValueError):
        return None
    return [t - times[0] for t in times]


def build_panels(runs: Sequence[RunData]) -> list[Panel]:
    """Every panel the runs' metrics fill, in reading order; the empty ones left out."""
    found = components(runs)
    own = [c for c in found if not same_as_reward(runs, c)]
    folded = "".join(f" (= {c})" for c in found if c not in own)
    # A run that samples nothing (--objective sft) has no staleness, and its objective's
    # panel shows its loss per token: the loss:sum and staleness panels would repeat them.
    sampled = any(run.has("time/sample") for run in runs)
    panels = [
        Panel(
            "reward",
            f"mean reward per step{folded}",
            _curves(runs, [("avg_reward", "")], smoothed=True),
        ),
        *_objective_panels(runs),
        Panel(
            "components",
            "reward components, mean per sample",
            _curves(runs, [(f"env/all/{c}", c) for c in own], first_style=1, smoothed=True),
        ),
        Panel(
            "component_rates",
            "reward components, % of samples with the component > 0",
            _curves(
                runs,
                [(f"env/all/{c}/rate", c) if shaped(runs, c) else ("", c) for c in own],
                first_style=1,
                percent=True,
            ),
            percent=True,
        ),
        _held_out(runs, own, folded),
        Panel(
            "episodes",
            "per episode: turns and the environment's counts",
            _curves(runs, [(k, k.removeprefix("env/all/")) for k in episode_counts(runs)]),
        ),
        Panel(
            "endings",
            "episode endings, % of episodes",
            _curves(
                runs,
                [(k, _ENDINGS.get(k, k.removeprefix("env/all/outcome/"))) for k in endings(runs)],
                percent=True,
            ),
            percent=True,
        ),
        Panel(
            "loss",
            "RL loss per trained token (the step's loss:sum / its tokens)",
            _per_token_loss(runs) if sampled else [],
        ),
        Panel(
            "kl",
            "KL(sampler || trainer)",
            _curves(runs, [("optim/kl_sample_train_v1", "v1"), ("optim/kl_sample_train_v2", "v2")]),
        ),
        Panel(
            "entropy",
            "sampler entropy, nats per sampled token",
            _curves(runs, [("optim/entropy", "")]),
        ),
        Panel(
            "grad_norm",
            "gradient norm (before clipping)",
            _curves(runs, [("optim/grad_norm", "")]),
        ),
        Panel(
            "staleness",
            "off-policy staleness (steps behind the trainer)",
            _curves(runs, [("off_policy/staleness", "")] if sampled else [], steps=True),
        ),
        Panel(
            "length",
            "response length, tokens",
            _curves(
                runs,
                [
                    ("response_len/mean", "mean"),
                    ("response_len/max", "max"),
                    ("env/all/tokens_per_episode", "context per episode"),
                ],
            ),
        ),
        Panel(
            "fractions",
            "% of groups trained; % of responses truncated, empty",
            _curves(runs, list(_FRACTIONS), percent=True),
            percent=True,
        ),
        _stage_medians(runs),
        _stages_by_wall_clock(runs),
        Panel(
            "throughput",
            f"throughput, {'samples' if sampled else 'trained tokens'} per second",
            _curves(
                runs,
                [("throughput/samples_per_s" if sampled else "throughput/tokens_per_s", "")],
            ),
        ),
        Panel(
            "tokens",
            "tokens billed over the run (cumulative)",
            _curves(runs, [(f"{CUMULATIVE}{k}", k) for k in KINDS]),
        ),
        Panel(
            "cost",
            "estimated cost over the run, USD (cumulative)",
            _curves(runs, [(COST_CUMULATIVE, "")]),
        ),
    ]
    return [p for p in panels if p.has_value]


def _per_token_loss(runs: Sequence[RunData]) -> list[Curve]:
    """The RL loss per trained token of each step: the server's ``loss:sum`` adds up
    every trained token's term (``optim/loss``), so its size follows the step's
    ``optim/trained_tokens``, not how well it trained."""
    curves = []
    for i, run in enumerate(runs):
        steps, losses = run.series("optim/loss")
        tokens = run.series("optim/trained_tokens")[1]
        per_token = [
            loss / n if loss is not None and n else None
            for loss, n in zip(losses, tokens, strict=True)
        ]
        curves.append(Curve(i, "", [float(s) for s in steps], per_token))
    return curves


def _eval_curves(
    runs: Sequence[RunData],
    names: Sequence[tuple[str, str]],
    *,
    first_style: int = 0,
    scale: float = 1.0,
) -> list[Curve]:
    """One curve of points per (``eval/*`` metric, label) of ``names`` that a run's
    evaluations logged (``eval.jsonl``), in the style of its position."""
    return [
        Curve(
            i,
            what,
            [float(s) for s in run.eval_series(name)[0]],
            [None if v is None else v * scale for v in run.eval_series(name)[1]],
            (first_style + j) % len(STYLES),
            markers=True,
        )
        for i, run in enumerate(runs)
        for j, (name, what) in enumerate(names)
        if run.eval_has(name)
    ]


def _held_out(runs: Sequence[RunData], own: Sequence[str], folded: str) -> Panel:
    """Held-out means, one point per evaluation: the greedy reward, solid, then each
    component in its line style of the components panel, then the sampled reward. A run
    whose steps log no reward (SFT's held-out first replies) names the component that
    is its held-out reward in the title."""
    if not any(run.has("avg_reward") for run in runs):
        keys = {k for run in runs for k in _keys(run.evals)}
        folded = "".join(
            f" (= {c})"
            for c in sorted(k.removeprefix("eval/") for k in keys if f"{k}/rate" in keys)
            if all(_same(run.evals, f"eval/{c}", "eval/reward/total") for run in runs)
        )
    names = [("eval/reward/total", "reward")] + [(f"eval/{c}", c) for c in own]
    names.append(("eval/sampled/reward/total", "reward, sampled (--eval-samples)"))
    title = f"held-out means{folded}, greedy, step 0 = before training"
    return Panel("held_out", title, _eval_curves(runs, names))


def _objective_panels(runs: Sequence[RunData]) -> list[Panel]:
    """What a run's objective measures besides the reward: supervised fine-tuning's
    loss (``sft/*``, held out: ``eval/sft/loss``), distillation's reverse KL to the
    teacher and the teacher's time (``distill/*``), preference pairs' loss, accuracy
    and implicit rewards (``dpo/*``, held out: ``eval/dpo/accuracy``)."""
    teacher = any(run.has("distill/teacher_frac") for run in runs)
    return [
        Panel(
            "sft_loss",
            "SFT loss per assistant token (held out: step 0 = before)",
            _curves(runs, [("sft/loss", "training")], smoothed=True)
            + _eval_curves(runs, [("eval/sft/loss", "held out")], first_style=1),
        ),
        Panel(
            "distill_kl",
            "reverse KL to the teacher, per sampled token",
            _curves(runs, [("distill/reverse_kl", "")], smoothed=True),
        ),
        Panel(
            "teacher",
            "% of each step: teacher asked; trainer idle",
            _curves(
                runs,
                [("distill/teacher_frac", "teacher in flight")]
                + ([("trainer/idle_ratio", "trainer idle")] if teacher else []),
                percent=True,
            ),
            percent=True,
        ),
        Panel("dpo_loss", "DPO loss per pair", _curves(runs, [("dpo/loss", "")], smoothed=True)),
        Panel(
            "dpo_accuracy",
            "preference accuracy, % of pairs (chosen > rejected)",
            _curves(runs, [("dpo/accuracy", "training")], percent=True, smoothed=True)
            + _eval_curves(runs, [(HELD_OUT_ACCURACY, "held out")], first_style=1, scale=100.0),
            percent=True,
        ),
        Panel(
            "dpo_rewards",
            "implicit rewards (beta x log ratio to the reference)",
            _curves(
                runs,
                [
                    ("dpo/chosen_reward", "chosen"),
                    ("dpo/rejected_reward", "rejected"),
                    ("dpo/margin", "margin"),
                ],
            ),
        ),
    ]


def _stage_medians(runs: Sequence[RunData]) -> Panel:
    """Median seconds per step in each stage a run logged, one bar per run (side by
    side: the stages overlap when sampling runs ahead)."""
    stages = [s for s in STAGES if any(run.has(f"time/{s}") for run in runs)]
    bars = []
    for i, run in enumerate(runs):
        medians = []
        for stage in stages:
            values = [v for v in run.series(f"time/{stage}")[1] if v is not None]
            medians.append(statistics.median(values) if values else 0.0)
        bars.append(Bars(i, medians))
    return Panel(
        "stage_medians",
        "median seconds per step, by stage",
        xlabel="",
        bars=bars,
        categories=[STAGES[s] for s in stages],
    )


def _stages_by_wall_clock(runs: Sequence[RunData]) -> Panel:
    """The stages' seconds of each step at the wall-clock time the step ended."""
    curves = [
        Curve(i, stage, xs, run.series(f"time/{stage}")[1], j)
        for i, run in enumerate(runs)
        if (xs := wall_clock(run)) is not None
        for j, stage in enumerate(("sample", "train", "wait", "step"))
        if run.has(f"time/{stage}")
    ]
    return Panel(
        "wall_clock",
        "seconds per step by stage, against wall clock",
        curves,
        xlabel="wall clock, s since step 1 ended",
    )


def draw_panels(
    runs: Sequence[RunData],
    smooth: Callable[[Sequence[float | None]], list[float | None]],
    title: str,
    smoothed: str = "smoothed",
) -> Figure:
    """The figure of :func:`build_panels`, three panels a row: one colour per run (one
    run: per line of a panel), whole steps on a step axis, a panel with smoothed lines
    says in its legend that the faint one is each step and the bold one ``smoothed``;
    each axes' gid is its panel's key."""
    from engine.observe.plotting import new_figure

    panels = build_panels(runs)
    rows = max(1, -(-len(panels) // COLUMNS))
    fig = new_figure(15, 3.9 * rows)
    for index, panel in enumerate(panels):
        ax = fig.add_subplot(rows, COLUMNS, index + 1)
        ax.set_gid(panel.key)
        _draw(ax, panel, runs, smooth, smoothed)
    fig.suptitle(title, fontsize=11)
    lines = title.count("\n") + 1
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.22 * lines / fig.get_figheight()))
    return fig


def _draw(
    ax: Any,
    panel: Panel,
    runs: Sequence[RunData],
    smooth: Callable[[Sequence[float | None]], list[float | None]],
    smoothed: str,
) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    from engine.observe.plotting import color

    several = len(runs) > 1
    keyed: list[Any] = []  # the legend: what a line's colour or style alone cannot say
    for curve in panel.curves:
        label = runs[curve.run].label
        if curve.what:
            label = f"{label}: {curve.what}" if several else curve.what
        line, marker = STYLES[curve.style]
        ys = _nan(curve.ys)
        # Several runs: a colour per run (its label in the legend); one run: per line.
        hue = color(curve.run if several else curve.style)
        look: dict[str, Any] = {"color": hue, "ls": line, "marker": marker, "ms": 3}
        if curve.markers and not marker:
            look["marker"] = "o"
        if curve.steps:
            drawn = ax.step(curve.xs, ys, where="mid", lw=2, label=label, **look)
        elif curve.smoothed:
            ax.plot(curve.xs, ys, alpha=0.3, lw=1, **look)
            drawn = ax.plot(curve.xs, _nan(smooth(curve.ys)), lw=2, label=label, **look)
        else:
            drawn = ax.plot(curve.xs, ys, lw=1.5, label=label, **look)
        if several or curve.what:
            keyed += drawn
    width = 0.8 / max(1, len(panel.bars))
    for bar in panel.bars:
        offset = (bar.run - (len(panel.bars) - 1) / 2) * width
        xs = [x + offset for x in range(len(panel.categories))]
        bars = ax.bar(xs, bar.values, width, color=color(bar.run), label=runs[bar.run].label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        if several:
            keyed.append(bars)
    if panel.bars:
        ax.set_xticks(range(len(panel.categories)), list(panel.categories))
    if panel.percent:
        ax.set_ylim(-5.0, 105.0)
    if panel.xlabel == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.key == "staleness":
        ax.yaxis.get_major_locator().set_params(integer=True)
    if panel.key == "kl":
        ax.axhline(0.0, color="grey", lw=0.6)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(panel.xlabel)
    ax.grid(alpha=0.3)
    if any(curve.smoothed for curve in panel.curves):
        keyed += [
            Line2D([], [], color="0.3", lw=1, alpha=0.4, label="faint: each step"),
            Line2D([], [], color="0.3", lw=2, label=f"bold: {smoothed}"),
        ]
    if len(keyed) > 1:
        ax.legend(handles=keyed, fontsize=7)


def _nan(values: Sequence[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]
