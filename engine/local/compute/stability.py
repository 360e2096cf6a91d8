"""Stability records for ``stable_reinforce``: what the sampler saw, kept by sequence id.

A sample request with ``record_stability_info`` has each of its sequences recorded (its
tokens and the sampler's logprob of each, under the distribution it was drawn from). A
``stable_reinforce`` datum names, through its ``loss_fn_input_spans``, which sampled
sequence each of its target positions reproduces; the server then takes the behaviour
logprobs from the record instead of trusting the client (docs/losses.md). Records belong
to the session that sampled them, expire ``ttl_s`` after their last use (the hosted
service keeps them a day) and are bounded in number (the oldest go first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.local.http.wire import (
    ForwardBackwardInputW,
    ProvenanceSpanW,
    WireError,
    tensor_of,
    token_count,
)

DEFAULT_TTL_S = 24 * 3600.0
STABILITY_MASK = "stability_mask"
"""The loss input the server fills: 1 where a target position is a recorded sampled
token, 0 elsewhere (prompt runs); ``stable_reinforce`` trains only where it is 1."""


@dataclass
class _Record:
    session_id: str | None
    tokens: list[int]
    logprobs: list[float]
    used_at: float


class StabilityRecords:
    """Recorded sequences by ``sequence_id``. Event-loop only (no locking)."""

    def __init__(
        self, now: Callable[[], float], *, max_records: int, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        self._now = now
        self._max = max_records
        self._ttl_s = ttl_s
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def record(
        self, session_id: str | None, sequence_id: str, tokens: list[int], logprobs: list[float]
    ) -> None:
        self._expire()
        self._records[sequence_id] = _Record(session_id, tokens, logprobs, self._now())
        self._records.move_to_end(sequence_id)
        while len(self._records) > self._max:
            self._records.popitem(last=False)

    def behaviour(
        self,
        session_id: str | None,
        spans: Sequence[ProvenanceSpanW],
        targets: torch.Tensor,
        where: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The behaviour logprobs (N,) of a datum's targets and its ``STABILITY_MASK``
        (N,), from ``spans`` tiling ``targets``; each sampled run must name a recorded
        sequence of this session and reproduce its tokens."""
        self._expire()
        n = int(targets.shape[0])
        total = sum(span.length for span in spans)
        if total != n:
            raise WireError(
                f"{where}.loss_fn_input_spans cover {total} positions but target_tokens has {n}"
            )
        logprobs = torch.zeros(n, dtype=torch.float32)
        mask = torch.zeros(n, dtype=torch.float32)
        start = 0
        for k, span in enumerate(spans):
            here = f"{where}.loss_fn_input_spans[{k}]"
            if span.kind == "sampled" and span.length:
                rec = self._records.get(span.sequence_id)
                if rec is None or rec.session_id != session_id:
                    raise WireError(
                        f"{here}: sequence_id {span.sequence_id!r} has no stability record in "
                        "this session (sample with record_stability_info=True; records last "
                        f"{self._ttl_s:.0f} s after their last use and do not survive a restart)"
                    )
                stop = span.offset + span.length
                if stop > len(rec.tokens):
                    raise WireError(
                        f"{here}: offset {span.offset} + length {span.length} runs past the "
                        f"{len(rec.tokens)} tokens sequence {span.sequence_id!r} sampled"
                    )
                given = targets[start : start + span.length].tolist()
                if given != rec.tokens[span.offset : stop]:
                    raise WireError(
                        f"{here}: target_tokens at positions {start}..{start + span.length - 1} "
                        f"are not the tokens sequence {span.sequence_id!r} sampled there"
                    )
                logprobs[start : start + span.length] = torch.tensor(
                    rec.logprobs[span.offset : stop], dtype=torch.float32
                )
                mask[start : start + span.length] = 1.0
                rec.used_at = self._now()
                self._records.move_to_end(span.sequence_id)
            start += span.length
        return logprobs, mask

    def _expire(self) -> None:
        cutoff = self._now() - self._ttl_s
        while self._records:
            oldest_id, oldest = next(iter(self._records.items()))
            if oldest.used_at >= cutoff:
                return
            del self._records[oldest_id]


def stability_inputs(
    records: StabilityRecords, session_id: str | None, inp: ForwardBackwardInputW
) -> list[dict[str, torch.Tensor]]:
    """Per datum, the ``logprobs`` and ``STABILITY_MASK`` loss inputs the server fills in
    from its records (they replace any the client sent)."""
    out: list[dict[str, torch.Tensor]] = []
    for i, datum in enumerate(inp.data):
        where = f"data[{i}]"
        if datum.loss_fn_input_spans is None:
            raise WireError(
                f"{where} has no provenance: {inp.loss_fn} needs each datum's target positions "
                "attributed to sampled sequences (Datum.with_provenance)"
            )
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise WireError(f"{where}: missing loss input 'target_tokens'")
        n = token_count(datum.model_input)
        ids = tensor_of(targets, f"{where}.loss_fn_inputs.target_tokens", n)
        logprobs, mask = records.behaviour(session_id, datum.loss_fn_input_spans, ids, where)
        out.append({"logprobs": logprobs, STABILITY_MASK: mask})
    return out
