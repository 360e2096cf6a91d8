"""The protobuf side of the wire, as tinker 0.38 speaks it.

tinker 0.38 sends ``forward_backward`` as ``application/x-protobuf`` (zstd-compressed
when the client config sets ``proto_compress_fwdbwd``) and asks for ``SampleResponse`` and
``ForwardBackwardOutput`` results as protobuf (``Accept: application/x-protobuf`` on
``retrieve_future``). tinker 0.22 speaks JSON, but for ``forward_backward``, which it
sends as uncompressed protobuf of its own (compatible) schema when the client config sets
``proto_write_fwdbwd``. The server keeps ONE model of each request and result, the JSON
shape: a protobuf request is decoded into the same dict a JSON client would have sent (so
validation, dedupe, ordering and errors are shared), and a finished result is encoded as
protobuf only when the poll asks for it.

``tinker_public_pb2`` is the generated module shipped in the tinker 0.38.0 wheel
(``tinker/proto/tinker_public_pb2.py``, Apache-2.0, see ``LICENSE`` here), vendored
unchanged because the server's environment pins tinker 0.22, which has no schema.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from engine.local.http.tinker_proto import tinker_public_pb2 as pb

PROTO_CONTENT_TYPE = "application/x-protobuf"
MASK_LOGPROB = -99999.0
"""Empty cells of a top-k matrix (token id 0 with this logprob), as the SDK reads them."""

PROTO_RESULT_ENDPOINTS = frozenset({"forward_backward", "forward", "asample"})
"""Futures whose results the SDK can take as protobuf (the rest are always JSON)."""

_DTYPE_NAMES: dict[int, str] = {
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_INT64: "int64",
    pb.DTYPE_INT32: "int64",
}
_DTYPE_NUMPY: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}


class ProtoError(ValueError):
    """The body is not a valid protobuf (or zstd) message; the message is for the client."""


def is_proto(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == PROTO_CONTENT_TYPE


def wants_proto(accept: str | None) -> bool:
    return PROTO_CONTENT_TYPE in (accept or "").lower()


# ---- request bodies -------------------------------------------------------------------


def zstd_available() -> bool:
    """Whether zstd bodies can be read (the client config asks for them only then)."""
    return importlib.util.find_spec("zstandard") is not None


def decompress(raw: bytes, encoding: str | None, limit: int) -> bytes:
    """``raw`` without its Content-Encoding (identity or zstd); a body that would inflate
    beyond ``limit`` bytes is refused before it is expanded further."""
    name = (encoding or "identity").strip().lower()
    if name == "identity":
        return raw
    if name != "zstd":
        raise ProtoError(
            f"Content-Encoding {encoding!r} is not supported by the local server (zstd only)"
        )
    try:
        import zstandard
    except ImportError:
        raise ProtoError(
            "zstd request bodies need the zstandard package: pip install 'engine[local]'"
        ) from None
    chunks: list[bytes] = []
    size = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
            while chunk := reader.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise ProtoError(
                        f"the zstd request body inflates beyond the local server's limit of "
                        f"{limit} bytes; send fewer datums per request"
                    )
                chunks.append(chunk)
    except zstandard.ZstdError as exc:
        raise ProtoError(f"request body is not valid zstd: {exc}") from None
    return b"".join(chunks)


def forward_backward_body(raw: bytes) -> tuple[dict[str, Any], str]:
    """A protobuf ``ForwardBackwardRequest`` as the JSON body a 0.22 client would send to
    ``forward_backward`` (or, with ``forward_only``, to ``forward``), and a digest that is
    equal for resubmissions of the same request."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise ProtoError(f"request body is not a valid ForwardBackwardRequest: {exc}") from None
    digest = hashlib.blake2b(msg.SerializeToString(deterministic=True), digest_size=16).hexdigest()
    config: dict[str, Any] = {key: float(value) for key, value in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    inp: dict[str, Any] = {
        "data": [_datum(d, f"data[{i}]") for i, d in enumerate(msg.data)],
        "loss_fn": msg.loss_fn,
    }
    if config:
        inp["loss_fn_config"] = config
    body: dict[str, Any] = {"model_id": msg.model_id, "seq_id": msg.seq_id}
    body["forward_input" if msg.forward_only else "forward_backward_input"] = inp
    return body, digest


def training_endpoint(body: Any) -> str:
    """``forward`` for a forward-only request (tinker 0.38 has no /forward route)."""
    if isinstance(body, dict) and "forward_input" in body and "forward_backward_input" not in body:
        return "forward"
    return "forward_backward"


def _datum(datum: pb.Datum, where: str) -> dict[str, Any]:
    chunks: list[dict[str, Any]] = []
    for i, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            tokens = _array(chunk.encoded_text.tokens, np.dtype("<i4"), f"{where}.chunks[{i}]")
            chunks.append({"type": "encoded_text", "tokens": tokens.tolist()})
        else:
            # The shared validation refuses it with the text-only message.
            chunks.append({"type": "image" if kind == "image" else str(kind), "tokens": []})
    inputs = {
        name: _tensor(t, f"{where}.loss_fn_inputs.{name}")
        for name, t in datum.loss_fn_inputs.items()
    }
    out: dict[str, Any] = {"model_input": {"chunks": chunks}, "loss_fn_inputs": inputs}
    if datum.model_input_spans or datum.loss_fn_input_spans:
        out["model_input_spans"] = [_span(s) for s in datum.model_input_spans]
        out["loss_fn_input_spans"] = [_span(s) for s in datum.loss_fn_input_spans]
    return out


def _span(span: pb.ProvenanceSpan) -> dict[str, Any]:
    """A provenance run as ``engine.local.http.wire.ProvenanceSpanW`` reads it."""
    arm = span.sampled_tokens if span.WhichOneof("span") == "sampled_tokens" else span.prompt_tokens
    kind = "sampled" if span.WhichOneof("span") == "sampled_tokens" else "prompt"
    return {
        "kind": kind,
        "sequence_id": arm.sequence_id,
        "offset": int(arm.offset),
        "length": int(arm.length),
    }


def _tensor(tensor: pb.Tensor, where: str) -> dict[str, Any]:
    dtype = _DTYPE_NUMPY.get(tensor.dtype)
    name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None or name is None:
        raise ProtoError(f"{where} has unsupported dtype {tensor.dtype} (float32 or int64 only)")
    out: dict[str, Any] = {"dtype": name}
    if tensor.shape:
        out["shape"] = list(tensor.shape)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        out["data"] = _array(csr.values, dtype, where).tolist()
        out["sparse_crow_indices"] = _array(csr.crow_indices, np.dtype("<i8"), where).tolist()
        out["sparse_col_indices"] = _array(csr.col_indices, np.dtype("<i8"), where).tolist()
    else:
        out["data"] = _array(tensor.dense, dtype, where).tolist()
    return out


def _array(data: bytes, dtype: np.dtype[Any], where: str) -> np.ndarray[Any, Any]:
    if len(data) % dtype.itemsize:
        raise ProtoError(f"{where}: {len(data)} bytes are not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=dtype)


# ---- results ---------------------------------------------------------------------------


def encode_result(endpoint: str, payload: dict[str, Any]) -> bytes | None:
    """The protobuf form of a successful result, or None where the result has none
    (other endpoints, failures and try_again answers stay JSON)."""
    if "error" in payload or payload.get("type") == "try_again":
        return None
    if endpoint in ("forward_backward", "forward"):
        return forward_output(payload).SerializeToString()
    if endpoint == "asample":
        return sample_response(payload).SerializeToString()
    return None


def forward_output(payload: dict[str, Any]) -> pb.ForwardBackwardOutput:
    outputs: list[dict[str, Any]] = payload.get("loss_fn_outputs", [])
    msg = pb.ForwardBackwardOutput(
        loss_fn_output_type=str(payload.get("loss_fn_output_type", "")),
        metrics={k: float(v) for k, v in payload.get("metrics", {}).items()},
    )
    if not outputs:
        return msg
    arrays = [{name: _numpy(t) for name, t in out.items()} for out in outputs]
    layout = [{name: (a.dtype, a.shape[1:]) for name, a in datum.items()} for datum in arrays]
    # One batched record when every datum has the same fields, dtypes and trailing
    # shapes (always, for the built-in losses); otherwise one record per datum.
    groups = [arrays] if all(entry == layout[0] for entry in layout) else [[a] for a in arrays]
    for group in groups:
        record = msg.loss_fn_outputs.add(num_datums=len(group))
        for name in group[0]:
            parts = [datum[name] for datum in group]
            offsets = np.cumsum([0] + [p.nbytes for p in parts], dtype=np.int64)
            record.fields[name].CopyFrom(
                pb.BatchedTensor(
                    data=b"".join(p.tobytes() for p in parts),
                    offsets=offsets.astype("<i8").tobytes(),
                    dtype=pb.DTYPE_FLOAT32 if parts[0].dtype.kind == "f" else pb.DTYPE_INT64,
                    trailing_shape=list(parts[0].shape[1:]),
                )
            )
    return msg


def _numpy(tensor: dict[str, Any]) -> np.ndarray[Any, Any]:
    dtype = np.dtype("<f4") if tensor.get("dtype") == "float32" else np.dtype("<i8")
    array = np.asarray(tensor.get("data", []), dtype=dtype)
    shape = tensor.get("shape")
    return array.reshape(shape) if shape else array


def sample_response(payload: dict[str, Any]) -> pb.SampleResponse:
    msg = pb.SampleResponse()
    for seq in payload.get("sequences", []):
        out = msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP
            if seq["stop_reason"] == "stop"
            else (pb.STOP_REASON_LENGTH),
            tokens=np.asarray(seq["tokens"], dtype="<i4").tobytes(),
        )
        if seq.get("logprobs") is not None:
            out.logprobs = np.asarray(seq["logprobs"], dtype="<f4").tobytes()
    prompt = payload.get("prompt_logprobs")
    if prompt is not None:
        values = [math.nan if x is None else float(x) for x in prompt]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    topk = payload.get("topk_prompt_logprobs")
    if topk is not None:
        msg.topk_prompt_logprobs.CopyFrom(topk_matrix(topk))
    return msg


def topk_matrix(rows: Sequence[Sequence[Sequence[float]] | None]) -> pb.TopkLogprobs:
    """Rows of ``[token_id, logprob]`` pairs (None: nothing at that position) as the dense
    N x K matrices of the wire, padded with the SDK's empty-cell sentinel."""
    k = max((len(row) for row in rows if row), default=0)
    ids = np.zeros((len(rows), k), dtype="<i4")
    logprobs = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            ids[i, j] = int(token)
            logprobs[i, j] = float(logprob)
    return pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows)
    )
