"""Wire types: decode request JSON into backend values, encode backend results as JSON.

The client sends ``model_dump(exclude_none=True)`` bodies with ``type`` tags and may add
keys in later versions, so every model ignores unknown keys. Decoding problems become
one-line messages that name the offending field ("data[2].loss_fn_inputs.weights: ...")
rather than validation dumps.
"""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.local.compute.backend_types import AdamConfig, DatumIn, ForwardResult, SampledSequences

REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash_unordered", "unique"})


class WireError(ValueError):
    """The request is malformed; the message is meant for the client, verbatim."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# ---- shared pieces -----------------------------------------------------------------


class TensorDataW(_Wire):
    data: list[int | float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class ModelInputW(_Wire):
    chunks: list[dict[str, Any]]


class ProvenanceSpanW(_Wire):
    """One run of a datum field (tinker >= 0.38 ``Datum.with_provenance``): ``length``
    positions that reproduce ``[offset, offset + length)`` of the named sequence's
    sampled tokens (``sampled``) or of its request's prompt (``prompt``)."""

    kind: Literal["sampled", "prompt"]
    sequence_id: str
    offset: int = Field(default=0, ge=0)
    length: int = Field(ge=0)


class DatumW(_Wire):
    model_input: ModelInputW
    loss_fn_inputs: dict[str, TensorDataW]
    # tinker >= 0.38: provenance (spans tile model_input and target_tokens respectively)
    model_input_spans: list[ProvenanceSpanW] | None = None
    loss_fn_input_spans: list[ProvenanceSpanW] | None = None


class ForwardBackwardInputW(_Wire):
    data: list[DatumW]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class LoraConfigW(_Wire):
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class SamplingParamsW(_Wire):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


# ---- requests ----------------------------------------------------------------------


class CreateModelW(_Wire):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfigW | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None
    """tinker >= 0.38: {"type": "adamw"} (the default) or another optimizer."""
    rollout_correction_config: dict[str, Any] | None = None
    """MinT: the session-level rollout correction (``engine.local.compute.rollout_correction``)."""


class ModelRefW(_Wire):
    model_id: str


class ForwardBackwardW(_Wire):
    forward_backward_input: ForwardBackwardInputW
    model_id: str
    seq_id: int | None = None


class ForwardW(_Wire):
    forward_input: ForwardBackwardInputW
    model_id: str
    seq_id: int | None = None


class OptimStepW(_Wire):
    adam_params: AdamConfig | None = None
    optimizer_params: dict[str, Any] | None = None
    """tinker >= 0.38 sends parameters of an optimizer other than Adam here."""
    model_id: str
    seq_id: int | None = None


class SaveWeightsW(_Wire):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveForSamplerW(_Wire):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    kind: str = "snapshot"
    user_metadata: dict[str, Any] | None = None
    """tinker >= 0.38: "snapshot" or "inflight" (served as a snapshot)."""


class LoadWeightsW(_Wire):
    model_id: str
    path: str
    optimizer: bool = False
    seq_id: int | None = None


class ResumeFromStateW(_Wire):
    """tinker >= 0.38's create-from-state: one load_weights by session and model_seq_id
    (no model_id, no create_model first); the model id is ``<session_id>:train:<seq>``."""

    session_id: str
    model_seq_id: int
    path: str
    optimizer: bool = False
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None


class WeightsInfoW(_Wire):
    tinker_path: str


class CreateSamplingSessionW(_Wire):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class SampleW(_Wire):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    num_samples: int = 1
    prompt: ModelInputW
    sampling_params: SamplingParamsW
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    # tinker >= 0.38
    prompt_logprobs_last_n: int | None = None
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    record_stability_info: bool | None = None


class RetrieveFutureW(_Wire):
    request_id: str
    allow_metadata_only: bool = False


W = TypeVar("W", bound=_Wire)


def check_adamw(config: dict[str, Any] | None, where: str) -> None:
    """The local server trains with AdamW only (tinker >= 0.38 can ask for others)."""
    kind = (config or {}).get("type", "adamw")
    if kind != "adamw":
        raise WireError(
            f"{where} asks for the {kind!r} optimizer; the local server implements only "
            "AdamW (optimizer_config {'type': 'adamw'}, the default)"
        )


def parse(model: type[W], body: Any, what: str) -> W:
    """Validate ``body`` against ``model``; raise ``WireError`` with a short message."""
    if not isinstance(body, dict):
        raise WireError(f"{what} request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise WireError(f"invalid {what} request: {describe(exc)}") from None


def describe(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        parts.append(f"{loc or 'body'}: {err['msg']}")
    more = exc.error_count() - limit
    if more > 0:
        parts.append(f"and {more} more error(s)")
    return "; ".join(parts)


# ---- decoding into backend values ---------------------------------------------------


def tokens_of(model_input: ModelInputW, where: str) -> list[int]:
    """Flatten the text chunks of a ModelInput; image chunks are refused."""
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        kind = chunk.get("type", "encoded_text")
        if kind in ("image", "image_asset_pointer"):
            raise WireError(
                f"{where}.chunks[{i}] is an {kind} chunk: the local server serves a "
                "text-only model and accepts only encoded_text chunks"
            )
        if kind != "encoded_text":
            raise WireError(f"{where}.chunks[{i}] has unknown chunk type {kind!r}")
        raw = chunk.get("tokens")
        if not isinstance(raw, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in raw
        ):
            raise WireError(f"{where}.chunks[{i}].tokens must be a list of integer token ids")
        tokens.extend(raw)
    return tokens


def token_count(model_input: ModelInputW) -> int:
    """How many tokens a ModelInput declares (before any validation; for size limits)."""
    return sum(
        len(t) if isinstance(t := chunk.get("tokens"), list) else 0 for chunk in model_input.chunks
    )


def check_token_ids(tokens: list[int], vocab_size: int | None, where: str) -> None:
    if not tokens:
        return
    low, high = min(tokens), max(tokens)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        raise WireError(
            f"{where} contains token id {bad}, outside the model's vocabulary "
            f"[0, {vocab_size if vocab_size is not None else 'inf'})"
        )


def tensor_of(td: TensorDataW, where: str, length: int) -> torch.Tensor:
    """The 1-D tensor of ``length`` values a TensorData (dense or CSR) encodes. The
    declared shape is checked against ``length`` before anything is allocated, so a
    small request cannot make the server expand a huge sparse tensor."""
    dtype = torch.int64 if td.dtype == "int64" else torch.float32
    shape = td.shape
    if shape is not None and any((not isinstance(d, int)) or d < 0 for d in shape):
        raise WireError(f"{where}.shape must hold non-negative integers, got {shape}")
    declared = [len(td.data)] if shape is None else shape
    if declared != [length]:
        raise WireError(
            f"{where} has shape {declared} but must be [{length}] (one value per model_input "
            "token; the client aligns targets, the server does not shift)"
        )
    if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
        raise WireError(
            f"{where} is sparse CSR, which encodes 2-D tensors; loss_fn_inputs are 1-D "
            "(send them dense)"
        )
    if len(td.data) != length:
        raise WireError(
            f"{where}.shape [{length}] needs {length} values but data has {len(td.data)}"
        )
    try:
        if dtype != torch.int64 or not td.data:
            return torch.tensor(td.data, dtype=dtype)  # NaN and infinity: the backend's check
        values = torch.tensor(td.data)  # a list holding any float becomes a float tensor
    except (ValueError, OverflowError):
        raise WireError(f"{where} holds a value outside the range of {td.dtype}") from None
    if values.is_floating_point():
        raise WireError(f"{where} has dtype int64 but non-integer values")
    return values


def datums_of(data: list[DatumW], *, where: str = "data") -> list[DatumIn]:
    """Backend datums; every loss_fn_input must be 1-D and as long as its model_input.
    What the values mean (token ids in the vocabulary, finite floats, the context
    length) is the backend's check (``engine.local.compute.datums.check_data``)."""
    out: list[DatumIn] = []
    for i, datum in enumerate(data):
        here = f"{where}[{i}]"
        tokens = tokens_of(datum.model_input, f"{here}.model_input")
        inputs = {
            name: tensor_of(td, f"{here}.loss_fn_inputs.{name}", len(tokens))
            for name, td in datum.loss_fn_inputs.items()
        }
        out.append(DatumIn(tokens=tokens, inputs=inputs))
    return out


# ---- encoding results ---------------------------------------------------------------


def tensor_json(tensor: torch.Tensor) -> dict[str, Any]:
    t = tensor.detach().cpu()
    dtype = "float32" if t.is_floating_point() else "int64"
    return {"data": t.flatten().tolist(), "dtype": dtype, "shape": list(t.shape)}


def check_metrics(metrics: dict[str, float], what: str) -> dict[str, float]:
    """Metric keys must be "name:reduction" with exactly one colon (the client splits on
    ':' to merge chunk results); values must be finite numbers."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name, _, reduction = key.partition(":")
        if not name or reduction not in REDUCTIONS or key.count(":") != 1:
            raise ValueError(f"{what} produced metric key {key!r}, not 'name:reduction'")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"{what} produced a non-finite metric {key}={number}")
        out[key] = number
    return out


def forward_json(result: ForwardResult) -> dict[str, Any]:
    return {
        "loss_fn_output_type": "TorchLossReturn",
        "loss_fn_outputs": [
            {name: tensor_json(t) for name, t in output.items()} for output in result.outputs
        ],
        "metrics": check_metrics(result.metrics, "forward_backward"),
    }


def sample_json(result: SampledSequences) -> dict[str, Any]:
    sequences = []
    for seq in result.sequences:
        logprobs = [float(x) for x in seq.logprobs]
        if not all(math.isfinite(x) for x in logprobs):
            raise ValueError("the sampler produced a non-finite logprob")
        sequences.append(
            {"tokens": list(seq.tokens), "logprobs": logprobs, "stop_reason": seq.stop_reason}
        )
    payload: dict[str, Any] = {"type": "sample", "sequences": sequences}
    if result.prompt_logprobs is not None:
        payload["prompt_logprobs"] = [
            None if x is None or not math.isfinite(x) else float(x) for x in result.prompt_logprobs
        ]
    if result.topk_prompt_logprobs is not None:
        payload["topk_prompt_logprobs"] = [
            None if row is None else [[int(t), float(lp)] for t, lp in row]
            for row in result.topk_prompt_logprobs
        ]
    return payload
