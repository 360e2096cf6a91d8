"""On-policy distillation's teacher (``--objective distill``, docs/distillation.md).

The student samples as in RL; each rolled-out group then gets the teacher's logprob of
every action token before it goes to the submitter: one ``prompt_logprobs`` request per
turn (its observation plus action, so an environment's or agent's episode gets every
action token scored in the context it was sampled in), all of a group's at once under
the rollout stage's ``--concurrency`` slots, retried like a sample request. The tokens
carry the logprobs from then on (checkpoints keep them: a resumed run trains the very
same advantages); :class:`~engine.core.datums.DistillSignal` turns them into per-token
advantages. A teacher that fails past its retries (a server error, weights that are
gone) stops the run after the steps in flight, as a sampling failure does, with one
line that names the teacher (:class:`TeacherFailed`); the stop checkpoint keeps every
group the teacher did score, and ``--resume`` asks it again for the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import anyio

from engine.common.clock import Stopwatch
from engine.core.trajectory import Trajectory, Turn
from engine.errors import ConfigError, EngineError, PermanentServiceError, ServiceError
from engine.session.api import SamplerHandle, Session

__all__ = ["Teacher", "TeacherFailed", "TeacherScores", "open_teacher", "tokenizer_mismatch"]


class TeacherFailed(EngineError):
    """The teacher's logprobs could not be had past the retries: the run stops after
    the steps in flight (exit 1) and resumes from its stop checkpoint."""

    def __init__(self, source: str, cause: ServiceError) -> None:
        super().__init__(
            f"the teacher {source} failed: {cause}; a teacher must stay reachable for the "
            "whole run (resume once it is)"
        )
        self.source = source


@dataclasses.dataclass(frozen=True)
class TeacherScores:
    """A group's trajectories with the teacher's logprobs, and when the teacher was
    asked and answered (clock values, metrics only)."""

    trajectories: tuple[Trajectory, ...]
    started: float
    finished: float


class Teacher:
    """Scores the student's samples with ``sampler``, the teacher's sampling client."""

    def __init__(self, session: Session, sampler: SamplerHandle, source: str) -> None:
        self._session = session
        self._sampler = sampler
        self.source = source

    async def score(
        self, trajectories: Sequence[Trajectory], slots: anyio.Semaphore, clock: Stopwatch
    ) -> TeacherScores:
        """``trajectories`` with ``teacher_logprobs`` on every turn that has an action."""
        started = clock()
        scored: list[list[Turn]] = [list(t.turns) for t in trajectories]

        async def one(i: int, j: int) -> None:
            turn = scored[i][j]
            async with slots:
                try:
                    logprobs = await self._session.prompt_logprobs(
                        self._sampler, (*turn.observation, *turn.action)
                    )
                except ServiceError as exc:
                    raise TeacherFailed(self.source, exc) from exc
            action = logprobs[len(turn.observation) :]
            if len(action) != len(turn.action) or any(lp is None for lp in action):
                raise EngineError(
                    f"the teacher {self.source} returned no logprob for some of the "
                    f"{len(turn.action)} tokens of a turn"
                )
            scored[i][j] = dataclasses.replace(
                turn, teacher_logprobs=tuple(float(lp) for lp in action if lp is not None)
            )

        async with anyio.create_task_group() as tg:
            for i, trajectory in enumerate(trajectories):
                for j, turn in enumerate(trajectory.turns):
                    if turn.action:
                        tg.start_soon(one, i, j)
        return TeacherScores(
            tuple(
                dataclasses.replace(t, turns=tuple(turns))
                for t, turns in zip(trajectories, scored, strict=True)
            ),
            started,
            clock(),
        )


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why ``teacher``'s tokens are not ``student``'s (None: the same tokenizer): the
    same object, or the same vocabulary and end-of-sequence token."""
    if student is teacher:
        return None
    vocab = [getattr(t, "get_vocab", lambda: None)() for t in (student, teacher)]
    if vocab[0] != vocab[1]:
        sizes = [len(v) if v is not None else "unknown" for v in vocab]
        return f"its vocabulary of {sizes[1]} tokens is not the student's {sizes[0]}"
    eos = [getattr(t, "eos_token_id", None) for t in (student, teacher)]
    if eos[0] != eos[1]:
        return f"its end-of-sequence token {eos[1]} is not the student's {eos[0]}"
    return None


async def open_teacher(session: Session, source: str, sampler_path: str) -> Teacher:
    """The teacher ``source`` names (``sampler_path``: the sampler weights or base model
    it resolved to), refused with a ConfigError unless it has the student's tokenizer."""
    try:
        sampler, tokenizer = await session.open_teacher(sampler_path)
    except PermanentServiceError as exc:  # refused: no such weights or model
        raise ConfigError(
            f"--teacher {source}: the server cannot open it ({exc}); a teacher is saved "
            "sampler weights, a run directory or a base model the server serves, with the "
            "student's tokenizer"
        ) from None
    except (OSError, ValueError) as exc:  # the SDK could not load the teacher's tokenizer
        raise ConfigError(
            f"--teacher {source}: its tokenizer could not be loaded to compare with the "
            f"student's ({exc}); a teacher must have the student's tokenizer"
        ) from None
    problem = tokenizer_mismatch(session.tokenizer, tokenizer)
    if problem is not None:
        raise ConfigError(
            f"--teacher {source} has another tokenizer than the student "
            f"{session.info.base_model}: {problem}; a teacher must share the student's tokens"
        )
    return Teacher(session, sampler, source)
