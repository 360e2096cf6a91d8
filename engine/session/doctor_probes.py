"""The doctor's probes of a server (``python -m engine.doctor``, :func:`probe_server`):
every capability in order, through the SDK probes a run also uses
(:mod:`engine.session.capabilities`) and plain HTTP.

Those the SDK cannot show (an auth check with a wrong key, the capabilities JSON,
``create_model``'s ``rollout_correction_config``, the backpressure header and its 408
queue answers, checkpoint TTL and upload) are plain HTTP with the API key in
``X-API-Key``; a server that wants the SDK's session token there (hosted MinT in JWT
mode) has them skipped.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import httpx

from engine.common.protocol import RECOMMENDED_FIELD, ROLLOUT_CORRECTIONS
from engine.config import EngineConfig
from engine.config.groups import TrainingSettings
from engine.config.values import LOSSES
from engine.core.datums import Completion
from engine.errors import EngineError, body_excerpt, classify
from engine.session.api import LossSpec
from engine.session.capabilities import (
    PROBE_PROMPT,
    PROBE_SAMPLING,
    PROBE_TIMEOUT_S,
    Finding,
    Skipped,
    probe,
    probe_checkpoint,
    probe_custom_loss,
    probe_loss,
    probe_optim_step,
    probe_prompt_logprobs,
    probe_sample,
    probe_session,
    refusal,
)
from engine.session.preflight import PreflightError

if TYPE_CHECKING:
    from engine.session.adapter import SdkSession

__all__ = ["NoServerAnswers", "probe_server"]

BACKPRESSURE_HEADER: Final = "X-Tinker-Sampling-Backpressure"
QUEUE_HEADERS: Final = ("X-Queue-Depth", "X-Queue-Position", "X-Queue-ETA-S", "X-Queue-Status")
MAX_ARCHIVE_BYTES: Final = 64 << 20
"""Largest checkpoint archive the upload probe downloads to send back (a bigger one is
skipped: a probe spends little)."""
_WRONG_KEY: Final = "engine-doctor-not-a-key"


class NoServerAnswers(EngineError):
    """No server answers at the URL (the doctor's exit 1)."""


# -- plain HTTP ----------------------------------------------------------------------------


class _Raw:
    """Plain requests to ``/api/v1/...`` with the API key; one attempt each."""

    def __init__(self, http: httpx.AsyncClient, sdk_version: str) -> None:
        self.http = http
        self.sdk_version = sdk_version

    async def post(self, path: str, body: object, **kwargs: Any) -> httpx.Response:
        return await self.http.post(path, json=body, **kwargs)

    async def future(
        self,
        path: str,
        body: object,
        *,
        headers: dict[str, str] | None = None,
        on_poll: Callable[[httpx.Response], None] | None = None,
    ) -> dict[str, Any]:
        """POST ``path`` and wait for its future's result (a 408 or 429 poll waits its
        Retry-After, at most 1 s, and polls again); a refusal raises its HTTP error."""
        answer = await self.post(path, body, headers=headers)
        answer.raise_for_status()
        request_id = answer.json()["request_id"]
        while True:
            polled = await self.post("retrieve_future", {"request_id": request_id})
            if on_poll is not None:
                on_poll(polled)
            if polled.status_code in (408, 429):
                await anyio.sleep(min(1.0, _retry_after(polled)))
                continue
            polled.raise_for_status()
            payload: dict[str, Any] = polled.json()
            if payload.get("type") == "try_again":
                continue
            if isinstance(payload.get("error"), str):
                raise _Refused(payload)
            return payload

    async def session(self) -> str:
        body: dict[str, object] = {"tags": [], "user_metadata": None}
        body |= {"sdk_version": self.sdk_version, "type": "create_session"}
        answer = await self.post("create_session", body)
        _require_token_free(answer)
        answer.raise_for_status()
        return str(answer.json()["session_id"])


class _Refused(EngineError):
    """A future that failed: ``category`` says whose fault (``user``: a refusal)."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(body_excerpt(str(payload["error"])))
        self.category = str(payload.get("category", ""))


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.0, float(response.headers.get("retry-after", "0.1")))
    except ValueError:
        return 0.1


def _require_token_free(response: httpx.Response) -> None:
    if response.status_code in (401, 403):
        raise Skipped(
            f"{response.request.url.path} wants the SDK's session token, not the API key "
            "(hosted MinT in JWT mode): not probed over plain HTTP"
        )


async def probe_auth(raw: _Raw, api_key: str | None) -> str:
    """Whether the server checks keys; refused when it rejects the key given."""
    body = {"sdk_version": raw.sdk_version}
    (await raw.post("client/config", body)).raise_for_status()
    wrong = await raw.http.post("client/config", json=body, headers={"X-API-Key": _WRONG_KEY})
    given = "the key given is accepted" if api_key else "no key given"
    if wrong.status_code in (401, 403):
        return f"a wrong key is refused ({wrong.status_code}); {given}"
    return f"any key is accepted (a wrong one answered {wrong.status_code}); {given}"


async def probe_models(raw: _Raw) -> str:
    answer = await raw.http.get("get_server_capabilities")
    _require_token_free(answer)
    answer.raise_for_status()
    models = answer.json().get("supported_models") or []
    names = []
    for entry in models:
        if not isinstance(entry, dict):
            continue
        text = str(entry.get("model_name"))
        if entry.get("max_context_length"):
            text += f" (context {entry['max_context_length']})"
        aliases = entry.get("aliases") or entry.get("model_aliases")
        if aliases:
            text += f" aliases {', '.join(map(str, aliases))}"
        recommended = entry.get(RECOMMENDED_FIELD)
        if isinstance(recommended, dict):
            text += f" recommends settings (service {recommended.get('service', 'local')})"
        names.append(text)
    if not names:
        raise EngineError("get_server_capabilities lists no model")
    return "; ".join(names)


async def probe_rollout_correction(raw: _Raw, base_model: str) -> str:
    body = {
        "session_id": await raw.session(),
        "model_seq_id": 0,
        "base_model": base_model,
        "lora_config": {"rank": 1},
        "rollout_correction_config": ROLLOUT_CORRECTIONS["mis"],
        "type": "create_model",
    }
    created = await raw.future("create_model", body)
    return f"create_model accepted rollout_correction_config (model {created.get('model_id')})"


async def probe_backpressure(raw: _Raw, base_model: str) -> str:
    """A sample sent with the backpressure header: accepted or refused, and whether a
    poll answered 408 with the queue's headers (seen only while the server queues)."""
    session_id = await raw.session()
    made = await raw.post(
        "create_sampling_session",
        {
            "session_id": session_id,
            "sampling_session_seq_id": 0,
            "base_model": base_model,
            "type": "create_sampling_session",
        },
    )
    made.raise_for_status()
    seen: dict[str, str] = {}

    def watch(polled: httpx.Response) -> None:
        if polled.status_code == 408:
            seen.update({h: polled.headers[h] for h in QUEUE_HEADERS if h in polled.headers})

    body = {
        "sampling_session_id": made.json()["sampling_session_id"],
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"tokens": list(PROBE_PROMPT), "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": PROBE_SAMPLING.max_tokens, "temperature": 1.0},
        "type": "sample",
    }
    await raw.future("asample", body, headers={BACKPRESSURE_HEADER: "1"}, on_poll=watch)
    if seen:
        fields = ", ".join(f"{k}={v}" for k, v in seen.items())
        return f"header accepted; queue fields seen ({fields})"
    return "header accepted; no 408 queue answer seen (the server did not queue this sample)"


def _checkpoint_route(tinker_path: str) -> str:
    """``training_runs/<id>/checkpoints/<kind>/<name>`` of a ``tinker://`` path."""
    run_id, kind, name = tinker_path.removeprefix("tinker://").split("/", 2)
    return f"training_runs/{run_id}/checkpoints/{kind}/{name}"


async def probe_ttl(raw: _Raw, sampler_path: str) -> str:
    answer = await raw.http.put(
        _checkpoint_route(sampler_path) + "/ttl", json={"ttl_seconds": 3600}
    )
    _require_token_free(answer)
    answer.raise_for_status()
    return f"set_checkpoint_ttl accepted on {sampler_path}"


async def probe_upload(raw: _Raw, sampler_path: str, uploaded: list[str]) -> str:
    """The sampler checkpoint's archive, downloaded (at most MAX_ARCHIVE_BYTES) and
    uploaded back as a new checkpoint (its path is added to ``uploaded``)."""
    archive = bytearray()
    async with raw.http.stream(
        "GET", _checkpoint_route(sampler_path) + "/archive", follow_redirects=True
    ) as answer:
        _require_token_free(answer)
        if answer.status_code >= 400:
            await answer.aread()  # the error's text, for its finding
            answer.raise_for_status()
        async for chunk in answer.aiter_bytes():
            archive.extend(chunk)
            if len(archive) > MAX_ARCHIVE_BYTES:
                raise Skipped(f"the checkpoint archive is over {MAX_ARCHIVE_BYTES >> 20} MiB")
    files = {"file": ("engine-doctor.tar.gz", bytes(archive), "application/gzip")}
    sent = await raw.http.post("checkpoints/upload", files=files)
    _require_token_free(sent)
    sent.raise_for_status()
    path = str(sent.json().get("tinker_path") or sent.json().get("path"))
    uploaded.append(path)
    return f"a {len(archive)}-byte archive uploaded as {path}"


async def cleanup(raw: _Raw, paths: Sequence[str]) -> str:
    """Delete the checkpoints the probes saved; says what is left."""
    left = []
    for path in paths:
        answer = await raw.http.delete(_checkpoint_route(path))
        if answer.status_code >= 400:
            left.append(f"{path} ({answer.status_code})")
    if left:
        return f"left on the server: {', '.join(left)}"
    return f"{len(paths)} checkpoint(s) deleted; the probe session is closed"


# -- the doctor ----------------------------------------------------------------------------


async def probe_server(
    session_class: type[SdkSession],
    config: EngineConfig,
    base_url: str,
    api_key: str | None,
    *,
    within: float = PROBE_TIMEOUT_S,
) -> list[Finding]:
    """Every probe, in order. Raises :class:`NoServerAnswers` when nothing answers at
    ``base_url``; anything else ends as a finding."""
    if session_class.sdk == "tinker":
        # Its samples then carry the stability records stable_reinforce's datum needs.
        config = config.replace(loss="stable_reinforce")
    findings: list[Finding] = []
    headers = {"X-API-Key": api_key} if api_key else {}
    api = base_url.rstrip("/") + "/api/v1/"
    limits = httpx.Timeout(within, connect=min(within, 10.0))
    async with httpx.AsyncClient(base_url=api, headers=headers, timeout=limits) as http:
        raw = _Raw(http, session_class.sdk_version)
        try:
            await http.post("client/config", json={"sdk_version": raw.sdk_version})
        except (httpx.TransportError, ValueError) as exc:
            raise NoServerAnswers(f"cannot reach {base_url}: {classify(exc).message}") from exc
        findings.append(await probe("auth", lambda: probe_auth(raw, api_key), within=within))
        if findings[-1].status == "refused":
            return [*findings, Finding("everything else", "skipped", "the API key is refused")]
        findings.append(await probe("models", lambda: probe_models(raw), within=within))
        opened_at = time.perf_counter()
        try:
            async with probe_session(session_class, config, base_url, api_key) as session:
                findings.append(
                    Finding(
                        "sdk and routes",
                        "supported",
                        f"{session.sdk} SDK (tinker {session.sdk_version}): client/config, "
                        "get_server_capabilities, create_session, create_model and "
                        f"get_tokenizer answered (throwaway LoRA rank "
                        f"{session.config.model.lora_rank} of {session.info.base_model})",
                        round(time.perf_counter() - opened_at, 3),
                    )
                )
                findings.extend(await _session_probes(session, raw, within))
        except PreflightError as exc:
            findings.append(
                Finding(
                    "sdk and routes",
                    "refused" if refusal(exc) else "error",
                    str(exc),
                    round(time.perf_counter() - opened_at, 3),
                )
            )
    return findings


async def _session_probes(session: SdkSession, raw: _Raw, within: float) -> list[Finding]:
    found: list[Finding] = []

    async def run(
        capability: str, fn: Callable[[], Awaitable[str]], *, trains: bool = False
    ) -> Finding:
        finding = await probe(capability, fn, within=within)
        found.append(finding)
        if trains and finding.status in ("refused", "error"):
            # A call refused before the server sequenced it leaves its place in the
            # training client's sequence empty, and every later call would wait on it.
            with contextlib.suppress(Exception):
                with anyio.fail_after(within):
                    await session.restore(None)
        return finding

    completions: list[Completion] = []

    async def sample() -> str:
        completions.append(await probe_sample(session))
        return f"{len(completions[0].tokens)} tokens with logprobs"

    if (await run("sample with logprobs", sample)).status != "supported":
        why = "no sample with logprobs to build the probes' datum from"
        return [*found, Finding("losses and checkpoints", "skipped", why)]
    completion = completions[0]
    await run("prompt logprobs", lambda: probe_prompt_logprobs(session))
    losses = [(f"loss {name}", run_loss_of(name)) for name in ("cross_entropy", *LOSSES)]
    losses += [(f"loss config {flag}", loss) for flag, loss in local_option_losses()]
    for capability, loss in losses:
        await run(capability, functools.partial(probe_loss, session, loss, completion), trains=True)
    await run("custom loss", lambda: probe_custom_loss(session, completion), trains=True)
    await run("optim_step", lambda: probe_optim_step(session), trains=True)
    saved: list[str] = []

    async def checkpoint() -> str:
        detail = await probe_checkpoint(session)
        saved.append(detail.rsplit("(", 1)[1].rstrip(")"))
        return detail

    await run("checkpoint with optimizer", checkpoint, trains=True)

    async def sampler_weights() -> str:
        saved.append(await session.save_weights_for_sampler("engine-doctor-sampler"))
        return f"saved {saved[-1]}"

    if (await run("sampler weights", sampler_weights)).status == "supported":
        sampler_path = saved[-1]
        await run("checkpoint ttl", lambda: probe_ttl(raw, sampler_path))
        await run("checkpoint upload", lambda: probe_upload(raw, sampler_path, saved))
    else:
        for name in ("checkpoint ttl", "checkpoint upload"):
            found.append(Finding(name, "skipped", "no sampler weights were saved"))
    base = session.info.base_model
    await run("rollout correction", lambda: probe_rollout_correction(raw, base))
    await run("sampling backpressure", lambda: probe_backpressure(raw, base))
    found.append(latency(found))
    if saved:
        await run("cleanup", lambda: cleanup(raw, saved))
    return found


def run_loss_of(name: str) -> LossSpec:
    """The loss ``name`` with the loss_fn_config a run sends by default."""
    if name == "cross_entropy":
        return LossSpec(name)
    return LossSpec(name, TrainingSettings(loss=name).loss_fn_config(1.0))  # type: ignore[arg-type]


def local_option_losses() -> list[tuple[str, LossSpec]]:
    """Each loss option of the engine's local server (its flag) with a loss that sends
    it: a hosted server may refuse these keys."""
    settings = (
        TrainingSettings(loss="importance_sampling", tis_cap=2.0),
        TrainingSettings(loss="ppo", mask_low=0.5, mask_high=2.0),
        TrainingSettings(loss="ppo", loss_temperature="sampling"),
    )
    return [
        (
            " ".join(s.local_loss_options()),
            LossSpec(s.loss, s.loss_fn_config(PROBE_SAMPLING.temperature)),
        )
        for s in settings
    ]


def latency(findings: Sequence[Finding]) -> Finding:
    """The seconds of each kind of call the probes timed (median where several)."""
    kinds: dict[str, list[float]] = {}
    for f in findings:
        if f.seconds is None or f.status != "supported":
            continue
        kind = "forward_backward" if f.capability.startswith("loss") else f.capability
        kinds.setdefault(kind, []).append(f.seconds)
    parts = [f"{k} {statistics.median(v):.3f}s" for k, v in kinds.items()]
    return Finding("latency", "supported", "; ".join(parts) or "nothing timed")
