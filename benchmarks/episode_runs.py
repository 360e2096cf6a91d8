"""Engine runs of a multi-turn workload on the latency clock, and the figures taken from
them: what ``benchmarks.multiturn`` (uneven 1..6-turn episodes) and
``benchmarks.long_episodes`` (heavy-tailed agent episodes) both measure.

Every configuration is a full engine run on the same server, problems and seed; the
workload's episodes time themselves into :class:`EpisodeLog` records (when each ran, and
when it waited for the model). Over the steady steps (step 2 to the last):

* steps/s as a pace: (n - 1) / (t_last - t_first) over the step end instants;
* cycles per step: the pace in latency clock cycles (1.0 is the clock's limit: one
  forward_backward + optim_step per cycle);
* server idle: the share of that window with no sample request and no training in
  flight (the time the model is asked nothing);
* straggler wait: the share of that window with no training in flight and at most a
  quarter of a step's episodes running (the rest of the step waits for its slowest
  episodes).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import anyio

from benchmarks.runners import TEMPERATURE, Target
from engine import Engine, EngineConfig, StepResult
from engine.envs.examples import guess_sum
from engine.envs.messages import MessageStep
from engine.tasks import Problem
from engine.tasks.arithmetic import score_arithmetic
from engine.tasks.render import ChatMessage

__all__ = [
    "BenchParser",
    "EpisodeLog",
    "ScriptedEnv",
    "busy_share",
    "overlapping",
    "run_engine",
    "speedups",
    "staleness",
    "summarize_run",
    "volumes",
]


@dataclass
class EpisodeLog:
    """When an episode ran, and when it waited for the model (sample requests);
    ``key`` names the episode (problem id and index in its group) where the workload
    knows it."""

    start: float
    end: float | None = None
    sampling: list[tuple[float, float]] = field(default_factory=list)
    key: str = ""


class ScriptedEnv:
    """A chat episode of ``length`` turns, each a short reply of the model; after a reply
    the environment waits ``waits[turn]`` seconds where given (a tool), then gives a
    hint (``Too high.``/``Too low.``, the guessing game's) unless the episode is done. The
    reward is the arithmetic reward of the first reply. Times itself into ``log``; at
    ``cap`` turns (the run's ``--env-max-turns``) the runner truncates it, so its record
    ends there."""

    def __init__(
        self,
        problem: Problem,
        length: int,
        waits: Mapping[int, float],
        log: list[EpisodeLog],
        *,
        cap: int | None = None,
        key: str = "",
    ) -> None:
        self.problem = problem
        self.length = length
        self.waits = waits
        self._cap = cap if cap is not None else length
        self._log = log
        self._key = key
        self._turns = 0
        self._reward = 0.0
        self._record: EpisodeLog | None = None
        self._asked = 0.0

    async def initial_messages(self) -> Sequence[ChatMessage]:
        now = time.perf_counter()
        self._record = EpisodeLog(now, key=self._key)
        self._log.append(self._record)
        self._asked = now
        return [{"role": "user", "content": self.problem.question}]

    async def respond(self, messages: Sequence[ChatMessage]) -> MessageStep:
        assert self._record is not None
        self._record.sampling.append((self._asked, time.perf_counter()))
        self._turns += 1
        reply = str(messages[-1].get("content", ""))
        if self._turns == 1:
            self._reward = score_arithmetic(reply, int(self.problem.answer)).total
        if wait := self.waits.get(self._turns):
            await anyio.sleep(wait)
        if self._turns >= self.length:
            self._record.end = time.perf_counter()
            return MessageStep(reward=self._reward, done=True, metrics={"turns": self._turns})
        if self._turns >= self._cap:
            self._record.end = time.perf_counter()
        guess = guess_sum.parse_guess(reply)
        hint = guess_sum.feedback(guess, int(self.problem.answer)) if guess is not None else None
        self._asked = time.perf_counter()
        return MessageStep(messages=[{"role": "user", "content": hint or guess_sum.TOO_LOW}])


def busy_share(
    intervals: Sequence[tuple[float, float]], lo: float, hi: float, *, at_least: int = 1
) -> float:
    """The share of [lo, hi] during which at least ``at_least`` of ``intervals`` are open."""
    events = sorted(
        [(max(a, lo), 1) for a, b in intervals if b > lo and a < hi]
        + [(min(b, hi), -1) for a, b in intervals if b > lo and a < hi]
    )
    open_now, last, covered = 0, lo, 0.0
    for instant, delta in events:
        if open_now >= at_least:
            covered += instant - last
        open_now += delta
        last = instant
    return covered / (hi - lo) if hi > lo else 0.0


def overlapping(intervals: Sequence[tuple[float, float]], k: int) -> list[tuple[float, float]]:
    """The periods during which at least ``k`` of ``intervals`` are open."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    out: list[tuple[float, float]] = []
    open_now, since = 0, 0.0
    for instant, delta in events:
        before = open_now
        open_now += delta
        if before < k <= open_now:
            since = instant
        elif before >= k > open_now:
            out.append((since, instant))
    return out


def summarize_run(
    results: Sequence[StepResult], log: Sequence[EpisodeLog], cycle_s: float
) -> dict[str, Any]:
    """Steps/s (pace over steps 2..n), cycles per step, server idle and straggler wait
    shares over the same window."""
    ends = [r.timeline.train_end for r in results]
    first, last = ends[1], ends[-1]
    pace = (last - first) / (len(ends) - 2)
    train = [(r.timeline.train_start, r.timeline.train_end) for r in results]
    sampling = [s for e in log for s in e.sampling]
    episodes = [(e.start, e.end) for e in log if e.end is not None]
    asked = busy_share([*sampling, *train], first, last)
    training = busy_share(train, first, last)
    # Waiting for stragglers: no training, and at most a quarter of a step's episodes
    # still running (the rest of the step is done and waits for them).
    crowd = math.ceil(len(episodes) / len(results) / 4) + 1
    working = busy_share([*train, *overlapping(episodes, crowd)], first, last)
    return {
        "steps": len(results),
        "steady_steps": len(ends) - 1,
        "pace_s": pace,
        "steps_per_s": 1 / pace,
        "cycles_per_step": pace / cycle_s,
        "server_idle": 1 - asked,
        "straggler_wait": 1 - working,
        "training_share": training,
        "episodes": len(episodes),
        "turns": sum(len(e.sampling) for e in log),
        "mean_reward": sum(float(r.metrics.get("avg_reward", 0.0)) for r in results) / len(results),
    }


def staleness(results: Sequence[StepResult]) -> dict[str, dict[str, int]]:
    """How many steps behind its training step each turn and each trajectory was sampled
    (the step, 0-based, less the sampler version the engine recorded: a trajectory's is
    its oldest turn's), as histograms {steps behind: count}."""
    turns: Counter[int] = Counter()
    trajectories: Counter[int] = Counter()
    for result in results:
        step = result.step - 1  # the 0-based step that trained it (not the one it was drawn for)
        for group in result.groups:
            for trajectory in group.trajectories:
                trajectories[step - trajectory.version] += 1
                turns.update(step - turn.version for turn in trajectory.turns)
    return {
        "per_turn": {str(k): turns[k] for k in sorted(turns)},
        "per_trajectory": {str(k): trajectories[k] for k in sorted(trajectories)},
    }


def volumes(results: Sequence[StepResult], started: int) -> dict[str, Any]:
    """What the steps sampled and trained: episodes that ended within a step's groups and
    their sampled (action) tokens; those trained (an unmasked trajectory of a group that
    carries a signal: the engine skips a group whose rewards tie); ``discarded``: episodes
    ``started`` (the workload's count) that no step trained, of which ``unscored`` never
    reached a step."""
    scored = trained = sampled_tokens = trained_tokens = 0
    outcomes: Counter[str] = Counter()
    for result in results:
        for group in result.groups:
            for trajectory in group.trajectories:
                scored += 1
                outcomes[trajectory.outcome] += 1
                sampled_tokens += trajectory.action_tokens
                if group.has_signal and not trajectory.masked:
                    trained += 1
                    trained_tokens += trajectory.action_tokens
    return {
        "episodes_started": started,
        "episodes_scored": scored,
        "episodes_trained": trained,
        "discarded": started - trained,
        "unscored": started - scored,
        "outcomes": dict(sorted(outcomes.items())),
        "tokens_sampled": sampled_tokens,
        "tokens_trained": trained_tokens,
        "sampled_per_trained_token": sampled_tokens / trained_tokens if trained_tokens else None,
    }


def run_engine(
    target: Target,
    task: Any,
    *,
    k: int | None,
    steps: int,
    batch: int,
    group: int,
    seed: int,
    max_turns: int,
    max_tokens: int,
    settings: Mapping[str, Any] | None = None,
) -> list[StepResult]:
    """One engine run of ``task`` (an environment or agent task) with K = ``k`` (None:
    the engine's default K and loss; 0: the batch-synchronous schedule with the
    on-policy ``importance_sampling`` loss) and any further schedule ``settings``
    (``step_order``, ``start_window``); its trained steps."""
    results: list[StepResult] = []
    schedule: dict[str, Any] = dict(settings or {})
    if k is not None:
        schedule["max_steps_off_policy"] = k
        if k == 0:
            schedule["loss"] = "importance_sampling"

    async def go() -> None:
        with tempfile.TemporaryDirectory(prefix="engine-bench-episodes-") as tmp:
            config = EngineConfig(
                base_url=target.base_url,
                api_key=target.api_key,
                steps=steps,
                batch=batch,
                group=group,
                max_tokens=max_tokens,
                temperature=TEMPERATURE,
                seed=seed,
                run_dir=Path(tmp) / "run",
                progress=False,
                env_max_turns=max_turns,
                **schedule,
            )
            async with Engine(config, task=task, on_step=results.append) as engine:
                await engine.run()

    anyio.run(go)
    return results


class BenchParser(argparse.ArgumentParser):
    """Usage errors in one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def speedups(rows: Mapping[str, dict[str, Any]], base: str) -> None:
    """Each row's ``speedup_vs_sync``: its steps/s over row ``base``'s (None without it)."""
    reference = rows.get(base)
    for row in rows.values():
        row["speedup_vs_sync"] = (
            row["steps_per_s"] / reference["steps_per_s"] if reference else None
        )
