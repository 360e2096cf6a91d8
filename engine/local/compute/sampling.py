"""Batched autoregressive sampling with a KV cache, for many requests at once.

All requests of one call that use the same weights run as ONE batch: each distinct
prompt is prefilled once (left-padded, with an attention mask and explicit position ids),
its KV cache rows are replicated for its ``num_samples``, and every decode step is a
single forward over all still-running rows (finished rows are dropped from the cache).

Logprob convention (matters for importance sampling; docs/losses.md): by default each
sampled token's logprob is its log-probability under the distribution it was actually
drawn from, i.e. the model's logits divided by the temperature, then restricted by
top-k / top-p and renormalised, as hosted Tinker reports it. With temperature 1 and no
truncation that is exactly the training policy's logprob, so an on-policy importance
ratio is 1. ``Request.tempered_logprobs=False`` (the server's ``sampling_logprobs
="untempered"``) reports the untempered model logprob instead. Greedy decoding
(temperature 0) has a degenerate sampling distribution, so it reports the untempered
model logprob. Prompt logprobs always use the untempered model (as ``compute_logprobs``
expects).

Randomness is per request: a request's ``seed`` seeds its own generator and every row
consumes it in a fixed order, so a request's samples do not depend on which other
requests share the batch.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

Tensor = torch.Tensor


@dataclass(frozen=True)
class Request:
    """One sampling request, already validated."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    tempered_logprobs: bool = True
    """Report each sampled token's logprob under the distribution it was drawn from (True,
    hosted Tinker's convention) or under the untempered model (False)."""


@dataclass
class Sequence_:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"
    behaviour_logprobs: list[float] | None = None
    """Each token's logprob under the distribution it was drawn from, when ``logprobs``
    reports another one (``tempered_logprobs=False``); None: ``logprobs`` are those."""


@dataclass
class Output:
    sequences: list[Sequence_]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


def _restrict(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k / nucleus to -inf (rows of one request)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the first token always stays (mass_before 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


_Policy = tuple[float, int, float, bool]
"""(temperature, top_k, top_p, tempered_logprobs): rows with equal policies are sampled
together."""


def _draw(logprobs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draw per row, with that row's uniform in [0, 1) (shape (rows, 1))."""
    probs = logprobs.exp()
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(-1)
    # u * total can round up to total; fall back to the last token with mass
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(idx, last_nonzero)


def _choose(
    logits: Tensor, policy: _Policy, draws: list[tuple[torch.Generator, int]]
) -> tuple[Tensor, Tensor, Tensor]:
    """Next token, its reported logprob (see module docstring) and its logprob under the
    distribution it was drawn from, for rows sharing one sampling policy. ``draws`` lists
    (generator, rows) per request in row order: each request's rows take one uniform
    each from its own generator."""
    logits = logits.float()
    temperature, top_k, top_p, tempered = policy
    if temperature == 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        chosen = logp.gather(-1, tok[:, None]).squeeze(-1)
        return tok, chosen, chosen
    scaled = _restrict(logits / temperature, top_k, top_p)
    logp = torch.log_softmax(scaled, dim=-1)
    uniforms = torch.cat([torch.rand(n, 1, generator=gen) for gen, n in draws])
    tok = _draw(logp, uniforms)
    behaviour = logp.gather(-1, tok[:, None]).squeeze(-1)
    if tempered:
        return tok, behaviour, behaviour
    untempered = torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
    return tok, untempered, behaviour


def cache_keyword(model: nn.Module) -> str:
    """The name of the model's KV-cache argument (and output attribute): transformers
    5.x renamed it; keep working on either side."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Sampler:
    """Runs a list of requests against one HF causal LM (the active adapter is set by the
    caller) as one batched computation."""

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_id: int,
        eos_ids: frozenset[int],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.model = model
        self._cache_kw = cache_keyword(model)
        self._trims_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._pad = pad_id
        self._eos = eos_ids
        self._decode = decode

    @torch.no_grad()
    def run(self, reqs: Sequence[Request]) -> list[Output]:
        width = max(len(r.prompt) for r in reqs)
        n_req = len(reqs)
        ids = torch.full((n_req, width), self._pad, dtype=torch.long)
        mask = torch.zeros((n_req, width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt, dtype=torch.long)
            mask[i, width - len(r.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_prompt = any(r.prompt_logprobs or r.topk_prompt_logprobs for r in reqs)
        trim = {"logits_to_keep": 1} if self._trims_logits and not want_prompt else {}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **trim
        )
        outputs = [Output(sequences=[Sequence_() for _ in range(r.num_samples)]) for r in reqs]
        if want_prompt:
            full = torch.log_softmax(out.logits.float(), dim=-1)
            for i, r in enumerate(reqs):
                self._fill_prompt_logprobs(outputs[i], full[i, width - len(r.prompt) :], r)
        last = out.logits[:, -1, :]
        cache = getattr(out, self._cache_kw)

        # one row per sample: replicate each prompt's cache rows
        row_req = torch.tensor([i for i, r in enumerate(reqs) for _ in range(r.num_samples)])
        row_seq = [(i, s) for i, r in enumerate(reqs) for s in range(r.num_samples)]
        cache.batch_select_indices(row_req)
        mask = mask[row_req]
        last = last[row_req]
        pos = positions[row_req, -1]
        gens = [self._generator(r) for r in reqs]

        live = list(range(len(row_seq)))  # cache rows still generating
        while True:
            next_tok = torch.full((len(row_seq),), self._pad, dtype=torch.long)
            next_lp = torch.zeros(len(row_seq))
            next_blp = torch.zeros(len(row_seq))
            by_policy: dict[_Policy, list[int]] = {}
            rows_of: dict[int, int] = {}  # request -> its number of live rows
            for k in live:
                ri = row_seq[k][0]
                r = reqs[ri]
                policy = (r.temperature, r.top_k, r.top_p, r.tempered_logprobs)
                by_policy.setdefault(policy, []).append(k)
                rows_of[ri] = rows_of.get(ri, 0) + 1
            for policy, rows in by_policy.items():
                # rows ascend and each request's rows are contiguous: one uniform per row,
                # drawn request by request in row order, as if each request ran alone
                requests = dict.fromkeys(row_seq[k][0] for k in rows)
                draws = [(gens[i], rows_of[i]) for i in requests]
                index = torch.tensor(rows)
                tok, lp, blp = _choose(last[index], policy, draws)
                next_tok[index] = tok
                next_lp[index] = lp
                next_blp[index] = blp
            keep: list[int] = []
            toks, lps, blps = next_tok.tolist(), next_lp.tolist(), next_blp.tolist()
            for k in live:
                ri, si = row_seq[k]
                r = reqs[ri]
                seq = outputs[ri].sequences[si]
                seq.tokens.append(toks[k])
                seq.logprobs.append(lps[k])
                if not r.tempered_logprobs:
                    if seq.behaviour_logprobs is None:
                        seq.behaviour_logprobs = []
                    seq.behaviour_logprobs.append(blps[k])
                if self._stopped(seq, r):
                    seq.stop_reason = "stop"
                elif len(seq.tokens) < r.max_tokens:
                    keep.append(k)
            if not keep:
                return outputs
            # Dropping finished rows copies the whole cache; do it only once they are at
            # least half of it (until then they ride along, fed padding, and are ignored).
            if 2 * len(keep) <= len(row_seq):
                idx = torch.tensor(keep)
                cache.batch_select_indices(idx)
                mask, pos, next_tok = mask[idx], pos[idx], next_tok[idx]
                row_seq = [row_seq[k] for k in keep]
                keep = list(range(len(keep)))
            live = keep
            mask = torch.cat([mask, torch.ones((len(row_seq), 1), dtype=torch.long)], dim=1)
            pos = pos + 1
            out = self.model(
                input_ids=next_tok[:, None],
                attention_mask=mask,
                position_ids=pos[:, None],
                use_cache=True,
                **{self._cache_kw: cache},
            )
            cache = getattr(out, self._cache_kw)
            last = out.logits[:, -1, :]

    def _stopped(self, seq: Sequence_, req: Request) -> bool:
        tok = seq.tokens[-1]
        if tok in self._eos or tok in req.stop_token_ids:
            return True
        if not req.stop_strings:
            return False
        text = self._decode(seq.tokens)
        return any(s in text for s in req.stop_strings)

    @staticmethod
    def _generator(req: Request) -> torch.Generator:
        gen = torch.Generator()
        gen.manual_seed(req.seed if req.seed is not None else secrets.randbits(63))
        return gen

    @staticmethod
    def _fill_prompt_logprobs(out: Output, logp: Tensor, req: Request) -> None:
        """``logp[t]`` is the distribution predicting prompt token t+1."""
        prompt = torch.tensor(req.prompt, dtype=torch.long)
        if req.prompt_logprobs:
            scores = logp[:-1].gather(-1, prompt[1:, None]).squeeze(-1).tolist()
            out.prompt_logprobs = [None, *scores]
        if req.topk_prompt_logprobs:
            k = min(req.topk_prompt_logprobs, logp.shape[-1])
            vals, idx = torch.topk(logp[:-1], k, dim=-1)
            rows: list[list[tuple[int, float]] | None] = [None]
            for v_row, i_row in zip(vals.tolist(), idx.tolist(), strict=True):
                rows.append(list(zip(i_row, v_row, strict=True)))
            out.topk_prompt_logprobs = rows
