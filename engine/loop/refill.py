"""Dynamic sampling (DAPO): which groups one step samples when ``--refill-groups E`` > 0.

A step draws ``batch + E`` problems when it opens: groups ``0..batch-1`` are its batch,
``batch..batch+E-1`` its reserves. Reserve ``j`` (group index ``batch + j``) is sampled
once more than ``j`` of the step's finished groups carry no signal
(:attr:`~engine.core.state.ScoredGroup.has_signal`: tied rewards, a reward error, a
prompt too long), so the step ends with ``batch`` groups that teach something, or with
every reserve spent (the step stayed short). Reserves start in index order, and which
ones a step samples depends only on the groups' outcomes, never on the order they
finished in: the step samples the fewest reserves ``n`` such that at most ``n`` of
groups ``0..batch+n-1`` carry no signal (or all ``E``). Each group's sampling seeds
derive from its (step, index) (:func:`~engine.core.seeds.sampling_seed`), so a resumed
or repeated run samples the same reserves with the same seeds.

On resume the step's checkpointed groups are known outcomes; a checkpointed reserve
means every reserve before it had been started, and they are started again if their
groups were not checkpointed.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.state import ScoredGroup

__all__ = ["StepRefill"]


class StepRefill:
    """The refill bookkeeping of one step of ``batch`` groups with ``extra`` reserves;
    ``restored`` are its groups kept by a checkpoint (not sampled again)."""

    def __init__(self, batch: int, extra: int, restored: Iterable[ScoredGroup] = ()) -> None:
        self._batch = batch
        self._extra = extra
        self._finished: set[int] = set()
        self._without_signal = 0
        self._started: set[int] = set()
        self.reserves = 0
        """Reserves started so far (groups ``batch..batch+reserves-1``)."""
        for group in restored:
            self._started.add(group.index)
            self._record(group)
            self.reserves = max(self.reserves, group.index - batch + 1)

    def to_start(self) -> list[int]:
        """The group indices to sample now (each returned once): at first every group
        of the batch not restored, then the reserves the outcomes so far call for."""
        while self._without_signal > self.reserves and self.reserves < self._extra:
            self.reserves += 1
        new = [i for i in range(self._batch + self.reserves) if i not in self._started]
        self._started.update(new)
        return new

    def finished(self, group: ScoredGroup) -> list[int]:
        """Record a finished group of the step; the reserves to sample because of it."""
        if group.index not in self._started or group.index in self._finished:
            raise ValueError(f"group {group.index} was not started, or finished twice")
        self._record(group)
        return self.to_start()

    @property
    def size(self) -> int | None:
        """The step's number of groups once it is final (None: a reserve may still be
        needed). Call after :meth:`to_start`."""
        if self.reserves == self._extra or self._finished >= self._started:
            return self._batch + self.reserves
        return None

    def _record(self, group: ScoredGroup) -> None:
        self._finished.add(group.index)
        if not group.has_signal:
            self._without_signal += 1
