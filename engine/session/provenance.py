"""Provenance for ``stable_reinforce``: which sampled sequence each datum token repeats.

tinker 0.38's ``stable_reinforce`` wants every datum's tokens attributed to the
``sequence_id`` sampling returned (``Datum.with_provenance``; docs/losses.md). The
engine's datums carry, on every trained position, the sampled token and the sampler's
logprob of it; a sampled sequence is identified by exactly that pair of runs. The session
keeps the sequences it sampled (``SampledIndex``, bounded) and finds, in each datum, the
run of trained positions each one fills. What the datum does not sample (the prompt, the
observations between turns) is attributed to the prompt of the next sampled sequence's
request: a datum is one run of turns whose observation extends the tokens before it, so
everything before an action is that action's request prompt, position for position.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from engine.errors import EngineError

DEFAULT_MAX_SEQUENCES = 65536


@dataclass(frozen=True)
class Span:
    """``length`` positions that repeat ``[offset, offset + length)`` of sequence
    ``sequence_id``'s sampled tokens (``sampled``) or of its request's prompt (``prompt``)."""

    kind: Literal["sampled", "prompt"]
    sequence_id: str
    offset: int
    length: int


def _bits(logprobs: Sequence[float] | np.ndarray) -> bytes:
    """The float32 bits of logprobs (the datum holds them as float32)."""
    return np.asarray(logprobs, dtype=np.float32).tobytes()


class SampledIndex:
    """Sampled sequences by ``sequence_id``, findable by their first (token, logprob);
    the oldest are forgotten beyond ``max_sequences``."""

    def __init__(self, max_sequences: int = DEFAULT_MAX_SEQUENCES) -> None:
        self._max = max_sequences
        self._sequences: OrderedDict[str, tuple[np.ndarray, bytes]] = OrderedDict()
        self._by_start: dict[tuple[int, bytes], list[str]] = {}

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, sequence_id: str, tokens: Sequence[int], logprobs: Sequence[float]) -> None:
        if not tokens or sequence_id in self._sequences:
            return
        ids = np.asarray(tokens, dtype=np.int64)
        self._sequences[sequence_id] = (ids, _bits(logprobs))
        self._by_start.setdefault(self._start(ids, _bits(logprobs)), []).append(sequence_id)
        while len(self._sequences) > self._max:
            old_id, (old_ids, old_bits) = self._sequences.popitem(last=False)
            key = self._start(old_ids, old_bits)
            ids_at = self._by_start[key]
            ids_at.remove(old_id)
            if not ids_at:
                del self._by_start[key]

    @staticmethod
    def _start(ids: np.ndarray, bits: bytes) -> tuple[int, bytes]:
        return int(ids[0]), bits[:4]

    def match(self, tokens: np.ndarray, logprobs: np.ndarray) -> tuple[str, int] | None:
        """The longest known sequence that ``tokens``/``logprobs`` begin with, and its
        length; None when none does."""
        bits = _bits(logprobs)
        best: tuple[str, int] | None = None
        for sid in self._by_start.get(self._start(tokens, bits), ()):
            ids, seq_bits = self._sequences[sid]
            n = len(ids)
            longer = n <= len(tokens) and (best is None or n > best[1])
            if longer and np.array_equal(ids, tokens[:n]) and seq_bits == bits[: 4 * n]:
                best = (sid, n)
        return best


def datum_provenance(
    index: SampledIndex,
    targets: np.ndarray,
    logprobs: np.ndarray,
    trained: np.ndarray,
    where: str,
) -> tuple[list[Span], list[Span]]:
    """The spans tiling a datum's model_input and its target_tokens. ``trained`` marks
    the target positions that are sampled tokens (the datum's ``weights``)."""
    n = len(targets)
    sampled: list[tuple[int, int, str]] = []  # (first target position, length, sequence)
    t = 0
    while t < n:
        if not trained[t]:
            t += 1
            continue
        found = index.match(targets[t:], logprobs[t:])
        if found is None:
            raise EngineError(
                f"stable_reinforce: {where}'s sampled tokens at position {t} match no "
                "response this session sampled (the datum must repeat each response whole, "
                "with the sampler's logprobs)"
            )
        sid, length = found
        if not all(trained[t : t + length]):
            raise EngineError(
                f"stable_reinforce: {where} trains only part of response {sid!r} at position {t}"
            )
        sampled.append((t, length, sid))
        t += length
    if not sampled:
        raise EngineError(f"stable_reinforce: {where} trains no sampled token")
    # target position t is token t + 1 of the full sequence (model_input = full[:-1])
    in_full = [(t + 1, length, sid) for t, length, sid in sampled]
    return _tile(in_full, 0, n), _tile(in_full, 1, n + 1)


def _tile(runs: list[tuple[int, int, str]], start: int, stop: int) -> list[Span]:
    """Spans over full-sequence positions ``[start, stop)``: the sampled ``runs``
    (start, length, sequence) and, between them, prompt runs of the next sequence."""
    spans: list[Span] = []
    at = start
    for begin, length, sid in runs:
        if begin > at:
            spans.append(Span("prompt", sid, at, begin - at))
        end = min(begin + length, stop)  # model_input lacks the last token
        if end > begin:
            spans.append(Span("sampled", sid, 0, end - begin))
        at = max(at, end)
    if at < stop:
        spans.append(Span("prompt", runs[-1][2], at, stop - at))
    return spans
