"""Which groups each step trains (``--step-order``), for the submitter.

``problem`` (:class:`ProblemOrder`): step ``s`` trains the groups drawn for it, so it
waits for its slowest episode. ``completion`` (:class:`CompletionOrder`): step ``s``
trains the first groups to finish whose sampler versions it may train (every turn at
least ``s - K``), so a straggling group trains in a later step instead of holding this
one. A group whose oldest turn has version ``v`` may train up to step ``v + K`` (its
deadline); a step waits for a group only when it is that group's last chance. Steps
keep their size (``--batch``): the rollout stage starts a drawn step ``t``'s groups once
the newest version is at least ``t - W`` (``--start-window``, at most K), so their
deadline is at least ``t + K - W``: with ``W = K`` a group's deadline is the step it was
drawn for (a straggler holds that step in any order), below K it has ``K - W`` steps of
slack, and a group that overruns its step trains in a later one, each later turn
sampled from the newest weights. Every untrained group's deadline is at least the step
it was drawn for, so at most ``(d - s + 1) x batch`` untrained groups have a deadline
``<= d`` for the steps ``s..d`` still to form, and a step takes a group only
while that stays true for every ``d`` (it then never needs to drop or resample one: the
bound holds for every turn of every trained group, and nothing sampled is left
untrained). Within a step the groups are in problem order (step drawn, then index), so
K=0, where every group's deadline is the step it was drawn for, trains exactly what
problem order does.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config.loop_settings import PipelineSettings
from engine.core.state import LoopState, ScoredGroup
from engine.errors import EngineError
from engine.loop.messages import GroupsStarted, RolledOut, StepClosed, StepOpened, steps_done

__all__ = ["ClosedStep", "CompletionOrder", "GroupKey", "ProblemOrder", "StepOrder"]

GroupKey = tuple[int, int]
"""A group's (step drawn for, index in that step)."""


def _key(group: ScoredGroup) -> GroupKey:
    return (group.step, group.index)


@dataclass(frozen=True)
class ClosedStep:
    """A step's groups (in problem order) and where the source and drawing stand once it
    is trained (the :class:`~engine.core.state.LoopState` fields)."""

    groups: tuple[ScoredGroup, ...]
    source_state: dict[str, Any]
    next_draw: int | None = None
    trained_ahead: tuple[GroupKey, ...] = ()


class StepOrder(Protocol):
    def receive(self, message: RolledOut, step: int) -> bool:
        """Take in a message of the rollout stage while step ``step`` forms; whether a
        group joined that step."""
        ...

    def arrived(self, step: int) -> dict[GroupKey, ScoredGroup]:
        """The groups of step ``step`` so far."""
        ...

    def complete(self, step: int) -> bool:
        """Whether step ``step`` has all its groups."""
        ...

    def close(self, step: int) -> ClosedStep:
        """Step ``step``'s groups, once :meth:`complete`; it forms no further."""
        ...


class ProblemOrder:
    """Step ``s`` trains the groups drawn for it (``restored``: kept by a checkpoint)."""

    def __init__(self, restored: Sequence[ScoredGroup]) -> None:
        self._waiting: dict[int, dict[GroupKey, ScoredGroup]] = {}
        for g in restored:
            self._waiting.setdefault(g.step, {})[_key(g)] = g
        self._source_after: dict[int, dict[str, Any]] = {}
        self._sizes: dict[int, int] = {}  # step -> its number of groups, once final

    def receive(self, message: RolledOut, step: int) -> bool:
        if isinstance(message, StepOpened):
            self._source_after[message.step] = message.source_after
        elif isinstance(message, StepClosed):
            self._sizes[message.step] = message.groups
        elif isinstance(message, ScoredGroup):
            self._waiting.setdefault(message.step, {})[_key(message)] = message
            return message.step == step
        return False

    def arrived(self, step: int) -> dict[GroupKey, ScoredGroup]:
        return self._waiting.get(step, {})

    def complete(self, step: int) -> bool:
        return len(self.arrived(step)) == self._sizes.get(step) and step in self._source_after

    def close(self, step: int) -> ClosedStep:
        arrived = self._waiting.pop(step)
        del self._sizes[step]
        return ClosedStep(tuple(arrived[k] for k in sorted(arrived)), self._source_after.pop(step))


class CompletionOrder:
    """Each step trains the first ``--batch`` groups to finish that the window lets it
    (module docstring), from the loop ``state`` a run starts at (``restored``: its
    untrained groups, first in line), under the run's pipeline ``settings``."""

    def __init__(
        self, settings: PipelineSettings, state: LoopState, restored: Sequence[ScoredGroup]
    ) -> None:
        self._batch = settings.batch
        self._window = settings.max_steps_off_policy
        self._steps = settings.steps
        # A step not started yet starts at this version or later (W behind it, and not
        # before the version the run resumes at): its groups' earliest deadline.
        self._start_lag = settings.start_lag
        self._first_version = state.sampler_version
        self._waiting = list(restored)  # finished, not in a step: in the order they finished
        self._running: dict[GroupKey, int] = {}  # started, unfinished -> deadline
        self._opened = state.draw_from  # the first drawn step whose groups have not started
        # Groups of steps not started yet that will not start: kept or already trained.
        self._known = Counter(g.step for g in restored)
        self._known.update(step for step, _ in state.trained_ahead)
        self._trained = set(state.trained_ahead)  # trained groups of step draw_from or later
        self._source_before = {state.draw_from: state.source_state}
        self._taken: dict[GroupKey, ScoredGroup] = {}

    def receive(self, message: RolledOut, step: int) -> bool:
        if isinstance(message, StepOpened):
            self._source_before[message.step + 1] = message.source_after
        elif isinstance(message, GroupsStarted):
            for index in message.indices:
                self._running[(message.step, index)] = message.admitted + self._window
            self._opened = message.step + 1
            self._known.pop(message.step, None)
        elif isinstance(message, ScoredGroup):
            del self._running[_key(message)]
            self._waiting.append(message)
        return self._take(step)

    def arrived(self, step: int) -> dict[GroupKey, ScoredGroup]:
        return self._taken

    def complete(self, step: int) -> bool:
        self._take(step)  # the groups that finished while the steps before it formed
        return len(self._taken) == self._batch

    def close(self, step: int) -> ClosedStep:
        taken, self._taken = self._taken, {}
        self._trained.update(taken)
        untrained = [*(_key(g) for g in self._waiting), *self._running]
        next_draw = min((s for s, _ in untrained), default=self._opened)
        self._trained = {k for k in self._trained if k[0] >= next_draw}
        return ClosedStep(
            tuple(taken[k] for k in sorted(taken)),
            self._source_before[next_draw],
            next_draw,
            tuple(sorted(self._trained)),
        )

    def _deadline(self, group: ScoredGroup) -> int:
        return group.version + self._window

    def _unstarted_deadline(self, drawn: int) -> int:
        """The earliest deadline of a group of step ``drawn`` not started yet."""
        return max(drawn - self._start_lag, self._first_version) + self._window

    def _take(self, step: int) -> bool:
        """Move the finished groups step ``step`` may take into it, first finished
        first; whether any moved."""
        room = self._batch - len(self._taken)
        took = False
        deadlines, before, after = self._excess(step)
        if max(before[-1], after[0]) > room:
            raise EngineError(
                f"internal error: step {steps_done(step)} cannot keep every group within "
                f"the staleness bound {self._window}"
            )
        for group in list(self._waiting):
            if room == 0:
                break
            # Without the group the counts due by its deadline or later drop by one.
            i = bisect.bisect_left(deadlines, self._deadline(group))
            if self._deadline(group) >= step and max(before[i], after[i] - 1) <= room - 1:
                self._waiting.remove(group)
                self._taken[_key(group)] = group
                room -= 1
                took = True
                deadlines, before, after = self._excess(step)
        return took

    def _excess(self, step: int) -> tuple[list[int], list[int], list[int]]:
        """How many groups step ``step`` must still take so that the later steps can
        train every untrained group by its deadline: over every ``d``, the groups due
        by step ``d`` beyond the ``(d - step) x batch`` places of steps
        ``step + 1..d``. Groups of steps not started yet count as due at their earliest
        deadline (:meth:`_unstarted_deadline`). Returns the deadlines ``d`` in order,
        the most over the deadlines before each (``before[i]``: those before
        ``deadlines[i]``) and over it and the ones after (``after[i]``), 0 at least."""
        due = Counter(self._deadline(g) for g in self._waiting)
        due.update(self._running.values())
        last = max(step, *due, self._unstarted_deadline(self._opened))
        # Beyond ``last`` each later step adds at most ``batch`` groups a step further
        # on: the excess only falls.
        for drawn in range(self._opened, self._steps):
            deadline = self._unstarted_deadline(drawn)
            if deadline > last:
                break
            due[deadline] += self._batch - self._known[drawn]
        deadlines = sorted(due)
        excess: list[int] = []
        count = 0
        for d in deadlines:
            count += due[d]
            excess.append(count - max(0, d - step) * self._batch)
        before = [0]
        for e in excess:
            before.append(max(before[-1], e))
        after = [0]
        for e in reversed(excess):
            after.append(max(after[-1], e))
        return deadlines, before, after[::-1]
