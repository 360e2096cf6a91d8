"""What a Tinker-compatible server can do for the engine, found by asking it.

The probes of ``python -m engine.doctor``
(:func:`engine.session.doctor_probes.probe_server`) and the subset a run checks before its
first sample (:func:`check_run_capabilities`) are the same functions (here): one rule for
"does the server take this". Each probe is one tiny call (a 2-token sample, one datum) on
a session of its own whose throwaway LoRA training client takes every gradient, optimizer
step and checkpoint, so a run's model never sees them; the session is closed after. A
probe ends as a :class:`Finding`: ``supported``, ``refused`` (the server's one-line
reason), ``error`` (it failed some other way: a timeout, a dropped connection) or
``skipped`` (why it does not apply).

Most probes go through the SDK of this environment, as a run would; the doctor's plain
HTTP ones are in :mod:`engine.session.doctor_probes`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

import anyio
import numpy as np

from engine.config import EngineConfig
from engine.config.values import TINKER_ONLY_LOSSES
from engine.core.datums import Completion, Datum, supervised_datums, trajectory_datums
from engine.core.trajectory import Trajectory, Turn
from engine.errors import ConfigError, EngineError, classify
from engine.session.api import CustomLossValue, LossSpec, SamplingParams, StepTicket
from engine.session.preflight import local_service
from engine.session.retry import service_guard

if TYPE_CHECKING:
    from engine.session.adapter import SdkSession

__all__ = [
    "CapabilityMissing",
    "Finding",
    "Need",
    "Skipped",
    "check_run_capabilities",
    "custom_loss_need",
    "loss_need",
    "probe",
    "probe_session",
    "prompt_logprobs_need",
    "refusal",
]

Status = Literal["supported", "refused", "error", "skipped"]

PROBE_TIMEOUT_S: Final = 60.0
"""Most one probe may take, retries included (a hang guard: each is one tiny call)."""
PROBE_PROMPT: Final = (1, 2, 3, 4)
"""Token ids every vocabulary has: no probe needs a tokenizer."""
PROBE_SAMPLING: Final = SamplingParams(max_tokens=2, temperature=1.0, seed=0)


class CapabilityMissing(ConfigError):
    """The server refuses something the run's settings need (exit 2, before sampling)."""


class _SilentRetryLog:
    """The probes' retry log: a probe's outcome is its finding, not its retries."""

    def warning(self, event: str, **fields: Any) -> None:
        return None

    def error(self, event: str, **fields: Any) -> None:
        return None


class Skipped(Exception):
    """The probe does not apply here; the message says why."""


@dataclass(frozen=True)
class Finding:
    """One capability's outcome; ``seconds``: how long its call(s) took."""

    capability: str
    status: Status
    detail: str
    seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def refusal(exc: BaseException) -> str | None:
    """The server's one-line reason when ``exc`` is its refusal (a 4xx answer other than
    408/429, or a failed future of category ``user``); None for any other failure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        code = getattr(response, "status_code", None)
        refused_status = isinstance(code, int) and 400 <= code < 500 and code not in (408, 429)
        if refused_status or str(getattr(current, "category", "")).lower().endswith("user"):
            return classify(current).message
        current = current.__cause__ or current.__context__
    return None


async def probe(
    capability: str, fn: Callable[[], Awaitable[str]], *, within: float = PROBE_TIMEOUT_S
) -> Finding:
    """Run one probe (``fn`` returns what it found) within ``within`` seconds."""
    start = time.perf_counter()
    try:
        with anyio.fail_after(within):
            detail = await fn()
    except Skipped as exc:
        return Finding(capability, "skipped", str(exc))
    except Exception as exc:
        seconds = round(time.perf_counter() - start, 3)
        reason = refusal(exc)
        if reason is not None:
            return Finding(capability, "refused", reason, seconds)
        return Finding(capability, "error", classify(exc).message, seconds)
    return Finding(capability, "supported", detail, round(time.perf_counter() - start, 3))


# -- the SDK probes ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def probe_session(
    session_class: type[SdkSession], config: EngineConfig, base_url: str, api_key: str | None
) -> AsyncIterator[SdkSession]:
    """A session of its own on a fresh throwaway LoRA (``config``'s base model and rank,
    never ``--init-from``), its calls guarded as ``config`` says; closed on exit."""
    if config.model.init_from is not None:
        config = config.replace(init_from=None, init_from_optimizer=False)
    async with session_class.connect(
        config,
        base_url,
        api_key,
        local=False,
        say=lambda line: None,
        guard=service_guard(config, log=_SilentRetryLog()),
        restore_from=None,
    ) as session:
        yield session


async def probe_sample(session: SdkSession) -> Completion:
    """A 2-token sample of the base model, with its logprobs."""
    sampler = await session.open_base_sampler()
    result = await session.sample(sampler, PROBE_PROMPT, 1, PROBE_SAMPLING)
    completion = result.completions[0]
    if not completion.tokens:
        raise EngineError("the sampler returned an empty response to the probe")
    if completion.logprobs is None or len(completion.logprobs) != len(completion.tokens):
        raise EngineError("the sampler returned no logprob per sampled token")
    return completion


def probe_datums(loss: str, completion: Completion) -> list[Datum]:
    """One datum of the probe prompt and ``completion`` in ``loss``'s layout."""
    turn = Turn(PROBE_PROMPT, completion.tokens, completion.logprobs, 0, completion.stop_reason)
    trajectory = Trajectory(turns=(turn,))
    if loss == "cross_entropy":
        return supervised_datums(trajectory)
    return trajectory_datums(trajectory, 1.0)


async def probe_loss(session: SdkSession, loss: LossSpec, completion: Completion) -> str:
    """One forward_backward of ``loss`` on the probe's training client."""
    if loss.name in TINKER_ONLY_LOSSES and session.sdk != "tinker":
        raise Skipped(f"the {session.sdk} SDK (tinker {session.sdk_version}) cannot send it")
    ticket = StepTicket(step=1)
    await session.submit_forward_backward(ticket, probe_datums(loss.name, completion), loss)
    await session.finish_train_step(ticket)
    return f"accepted (loss_fn_config keys: {', '.join(sorted(loss.config or {})) or 'none'})"


def _zero_loss(logprobs: Sequence[np.ndarray]) -> CustomLossValue:
    return CustomLossValue(0.0, [np.zeros_like(lp) for lp in logprobs])


async def probe_custom_loss(session: SdkSession, completion: Completion) -> str:
    """forward_backward_custom of a zero loss on the probe's training client."""
    why_not = session.custom_loss_refusal
    if why_not is not None:
        raise Skipped(why_not)
    ticket = StepTicket(step=1)
    datums = probe_datums("cross_entropy", completion)
    await session.submit_forward_backward_custom(ticket, datums, _zero_loss)
    await session.finish_train_step(ticket)
    return "forward_backward_custom ran (a forward pass, the client's loss, a backward pass)"


async def probe_prompt_logprobs(session: SdkSession) -> str:
    sampler = await session.open_base_sampler()
    logprobs = await session.prompt_logprobs(sampler, PROBE_PROMPT)
    if any(lp is None for lp in logprobs[1:]):
        raise EngineError("compute_logprobs left prompt tokens without a logprob")
    return f"{len(logprobs)} prompt tokens scored"


async def probe_optim_step(session: SdkSession) -> str:
    ticket = StepTicket(step=1)
    await session.submit_optim_step(ticket, 1e-6)
    await session.finish_train_step(ticket)
    return "applied (learning rate 1e-6)"


async def probe_checkpoint(session: SdkSession) -> str:
    """save_state, then a training client loaded from it with its optimizer state."""
    path = await session.save_state("engine-doctor-state")
    await session.restore(path, optimizer=True)
    return f"save_state and load with optimizer state ({path})"


# -- what a run checks ---------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """What a run asks of a server beyond sampling (which every run does, and whose
    failure says so at once), with the setting that asks it (its objective's
    :meth:`~engine.objectives.base.Objective.needs`)."""

    capability: str
    setting: str
    check: Callable[[SdkSession, Completion], Awaitable[str]]


def loss_need(loss: LossSpec, setting: str) -> Need:
    """Training with ``loss`` (its ``loss_fn_config`` keys named)."""
    keys = sorted(loss.config or {})
    what = f"train with loss {loss.name}" + (f" (loss_fn_config {', '.join(keys)})" if keys else "")
    return Need(what, setting, lambda s, c: probe_loss(s, loss, c))


def custom_loss_need(setting: str) -> Need:
    """A custom loss (``forward_backward_custom``)."""
    return Need("run a custom loss (forward_backward_custom)", setting, probe_custom_loss)


def prompt_logprobs_need(setting: str) -> Need:
    """Scoring prompts (``compute_logprobs``)."""
    return Need("score prompts (compute_logprobs)", setting, lambda s, c: probe_prompt_logprobs(s))


async def check_run_capabilities(
    session: SdkSession, needs: Sequence[Need], say: Callable[[str], None] = lambda line: None
) -> None:
    """Refuse (:class:`CapabilityMissing`, one line naming the capability and the setting
    that needs it) when the server ``session`` talks to refuses what the run's settings
    ``needs``, before the run samples. The engine's local server on its ``local`` service is
    not asked (it takes everything a run sends); on ``mint`` or ``tinker`` it is. A check
    that fails otherwise is said through ``say`` and the run goes on."""
    config = session.config
    base_url = session.info.base_url
    api_key = config.session.api_key_value
    if session.info.local or await local_service(base_url, api_key, session.guard) == "local":
        return
    async with probe_session(
        type(session), config, base_url, config.session.api_key_value
    ) as probing:
        completion = await probe_sample(probing)
        for need in needs:
            found = await probe(need.capability, functools.partial(need.check, probing, completion))
            if found.status == "refused":
                raise CapabilityMissing(
                    f"the server at {base_url} cannot {need.capability}, which {need.setting} "
                    f"needs: {found.detail} (python -m engine.doctor {base_url} lists what it "
                    "supports)"
                )
            if found.status == "error":
                say(f"Could not check that the server can {need.capability}: {found.detail}")
