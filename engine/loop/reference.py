"""The reference policy of ``--objective dpo`` (docs/dpo.md): its logprobs of each pair's
responses, asked once per pair.

The reference is the run's initial weights: the base model's sampler for a fresh LoRA,
the step-0 checkpoint's sampler weights with ``--init-from`` or on resume (the
supervisor sets :attr:`Reference.sampler` once per run). For each pair it asks
``prompt_logprobs`` of the prompt plus each response (both at once, at most
``--concurrency`` requests of the run in flight, retried like a sample request) and keeps
the logprobs of the response tokens, per pair, for the rest of the run: a pair trained
again in a later epoch, or evaluated again, is not asked again. The groups carry them
from then on (a checkpoint keeps the untrained ones: a resumed run trains those with the
very same reference logprobs, and asks the same reference for the pairs it has not seen).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import anyio

from engine.core.problems import Problem
from engine.core.trajectory import Trajectory
from engine.loop.teacher import action_logprobs
from engine.session.api import SamplerHandle, Session

__all__ = ["Reference"]


class Reference:
    """The reference sampler's logprobs of pairs' responses (see the module doc)."""

    def __init__(self, session: Session, concurrency: int) -> None:
        self._session = session
        self._slots = anyio.Semaphore(concurrency)
        self._kept: dict[tuple[str, int], tuple[tuple[float, ...], ...]] = {}
        self.sampler: SamplerHandle | None = None
        """The reference's sampling client; set once per run, before the first pair."""
        self.asked = 0
        """Responses whose logprobs were asked of the sampler (tests: once per pair)."""

    async def score(
        self, problem: Problem, trajectories: Sequence[Trajectory]
    ) -> tuple[Trajectory, ...]:
        """``trajectories`` (a pair's, one turn each) with the reference's logprob of
        each response token as the turn's ``logprobs``."""
        key = (str(problem.data.get("split", "train")), int(problem.data["row"]))
        kept = self._kept.get(key)
        if kept is None:
            kept = await self._ask(trajectories)
            self._kept[key] = kept
        return tuple(
            dataclasses.replace(t, turns=(dataclasses.replace(t.turns[0], logprobs=lp),))
            for t, lp in zip(trajectories, kept, strict=True)
        )

    async def _ask(self, trajectories: Sequence[Trajectory]) -> tuple[tuple[float, ...], ...]:
        sampler = self.sampler
        assert sampler is not None, "the supervisor opens the reference before the first pair"
        answers: list[tuple[float, ...]] = [()] * len(trajectories)

        async def one(i: int) -> None:
            turn = trajectories[i].turns[0]
            answers[i] = await action_logprobs(
                self._session, sampler, turn, self._slots, "the reference sampler"
            )

        async with anyio.create_task_group() as tg:
            for i in range(len(trajectories)):
                tg.start_soon(one, i)
        self.asked += len(trajectories)
        return tuple(answers)
