"""Fault injection: the spec grammar and the per-request decisions.

The engine must survive what a hosted service does on a bad day (5xx storms, rate limits,
lost answers, expired futures), and it must never apply a training step twice while doing
so. These faults let tests and benchmarks provoke each case on demand, deterministically.

Grammar (``--faults SPEC``; items separated by commas, whitespace ignored)::

    SPEC     := ITEM ("," ITEM)*              "" or "off" means no faults
    ITEM     := OPTION | RULE
    OPTION   := "seed=" INT                   RNG seed for rates (default 0)
              | "slow_s=" SECONDS             delay of a "slow" fault (default 1.0)
              | "retry_after_s=" SECONDS      Retry-After sent with 429 (default 1.0)
    RULE     := KIND ["~" PHASE] ["@" ENDPOINT ("|" ENDPOINT)*] ":" TRIGGER
    KIND     := "500" | "503" | "429" | "408"  answer that HTTP status
              | "drop"                        close the connection without an answer
              | "slow"                        answer after slow_s seconds
              | "410"                         retrieve_future answers 410 (future expired) once
                                              the operation finished (it is applied)
              | "fail"                        the future fails: 200 + category "server"
    PHASE    := "before"                      instead of handling the request (default)
              | "after"                       handle it (apply it), then lose the answer
    ENDPOINT := a path below /api/v1/ without ids, e.g. forward_backward, optim_step,
                asample, retrieve_future, client/config, samplers; for "410" and "fail"
                it names the endpoint that CREATED the future (asample, optim_step, ...)
    TRIGGER  := RATE                          probability in [0, 1] per matching request
              | "at=" N ("+" N)*              exactly the N-th matching requests (1-based)

Example: ``seed=7,500:0.02,drop~after@forward_backward|optim_step:at=3,410@asample:0.1``.

Rules are checked in order; every rule counts each request it matches (so "at" numbers
do not depend on other rules) and the first one that fires wins. ``healthz`` and the
local stats endpoint are never faulted. A "before" fault leaves the request unapplied; an
"after" fault applies it and then loses the answer, which exercises the server's
(model_id, seq_id) dedupe when the client resubmits.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

FaultKind = Literal["500", "503", "429", "408", "drop", "slow", "410", "fail"]
Phase = Literal["before", "after"]

HTTP_KINDS: frozenset[str] = frozenset({"500", "503", "429", "408", "drop", "slow"})
FUTURE_KINDS: frozenset[str] = frozenset({"410", "fail"})
ALL_KINDS: tuple[str, ...] = ("500", "503", "429", "408", "drop", "slow", "410", "fail")
NEVER_FAULTED: frozenset[str] = frozenset({"healthz", "local/stats"})


class FaultSpecError(ValueError):
    """The fault spec does not parse; the message quotes the offending item."""


@dataclass(frozen=True)
class FaultRule:
    kind: str
    phase: str = "before"
    endpoints: frozenset[str] = frozenset()
    """Empty: every endpoint."""
    rate: float = 0.0
    at: frozenset[int] = frozenset()

    def matches(self, endpoint: str) -> bool:
        return not self.endpoints or endpoint in self.endpoints

    def __str__(self) -> str:
        text = self.kind
        if self.phase != "before":
            text += f"~{self.phase}"
        if self.endpoints:
            text += "@" + "|".join(sorted(self.endpoints))
        trigger = "at=" + "+".join(str(n) for n in sorted(self.at)) if self.at else f"{self.rate:g}"
        return f"{text}:{trigger}"


@dataclass(frozen=True)
class FaultSpec:
    """A parsed, validated fault spec (empty by default: no faults)."""

    rules: tuple[FaultRule, ...] = ()
    seed: int = 0
    slow_s: float = 1.0
    retry_after_s: float = 1.0

    @property
    def enabled(self) -> bool:
        return bool(self.rules)

    @classmethod
    def parse(cls, spec: str | None) -> FaultSpec:
        """Parse the grammar in the module docstring; raise ``FaultSpecError`` on any
        malformed item, unknown kind, out-of-range rate or misplaced phase."""
        if spec is None or spec.strip() in ("", "off", "none"):
            return cls()
        rules: list[FaultRule] = []
        options: dict[str, float] = {}
        for raw in spec.split(","):
            item = "".join(raw.split())
            if not item:
                raise FaultSpecError(f"fault spec {spec!r} has an empty item (stray comma?)")
            if ":" not in item and "=" in item:
                _parse_option(item, options)
            else:
                rules.append(_parse_rule(item))
        seed = int(options.get("seed", 0))
        return cls(
            rules=tuple(rules),
            seed=seed,
            slow_s=options.get("slow_s", 1.0),
            retry_after_s=options.get("retry_after_s", 1.0),
        )

    def __str__(self) -> str:
        parts = [str(rule) for rule in self.rules]
        parts += [f"seed={self.seed}", f"slow_s={self.slow_s:g}"]
        parts.append(f"retry_after_s={self.retry_after_s:g}")
        return ",".join(parts) if self.rules else "off"


def _parse_option(item: str, options: dict[str, float]) -> None:
    key, _, value = item.partition("=")
    if key not in ("seed", "slow_s", "retry_after_s"):
        raise FaultSpecError(
            f"unknown fault option {key!r} in {item!r} (options: seed, slow_s, retry_after_s)"
        )
    try:
        number = int(value) if key == "seed" else float(value)
    except ValueError:
        kind = "an integer" if key == "seed" else "a number of seconds"
        raise FaultSpecError(f"fault option {item!r}: {key} must be {kind}") from None
    if key != "seed" and not (math.isfinite(number) and number >= 0):
        raise FaultSpecError(f"fault option {item!r}: {key} must be >= 0")
    options[key] = number


def _parse_rule(item: str) -> FaultRule:
    target, sep, trigger = item.partition(":")
    if not sep or not trigger:
        raise FaultSpecError(
            f"fault rule {item!r} needs a trigger: KIND:RATE or KIND:at=N (e.g. 500:0.02)"
        )
    target, at_sign, endpoint_text = target.partition("@")
    kind, _, phase = target.partition("~")
    if kind not in ALL_KINDS:
        raise FaultSpecError(
            f"unknown fault kind {kind!r} in {item!r} (kinds: {', '.join(ALL_KINDS)})"
        )
    phase = phase or "before"
    if phase not in ("before", "after"):
        raise FaultSpecError(f"fault rule {item!r}: phase must be 'before' or 'after'")
    if phase == "after" and kind in FUTURE_KINDS:
        raise FaultSpecError(f"fault rule {item!r}: {kind} has no 'after' variant")
    endpoints = (
        frozenset(e for e in endpoint_text.split("|") if e) if endpoint_text else frozenset()
    )
    if at_sign and (not endpoints or any(e.startswith("/") for e in endpoints)):
        raise FaultSpecError(
            f"fault rule {item!r}: endpoints are names like forward_backward|asample"
        )
    rate = 0.0
    at: frozenset[int] = frozenset()
    if trigger.startswith("at="):
        try:
            at = frozenset(int(n) for n in trigger[3:].split("+"))
        except ValueError:
            raise FaultSpecError(
                f"fault rule {item!r}: 'at=' takes request numbers like at=3 or at=2+5"
            ) from None
        if not at or min(at) < 1:
            raise FaultSpecError(f"fault rule {item!r}: request numbers start at 1")
    else:
        try:
            rate = float(trigger)
        except ValueError:
            raise FaultSpecError(
                f"fault rule {item!r}: trigger must be a rate in [0, 1] or at=N"
            ) from None
        if not 0.0 <= rate <= 1.0:
            raise FaultSpecError(f"fault rule {item!r}: rate must be in [0, 1], got {rate:g}")
    return FaultRule(kind=kind, phase=phase, endpoints=endpoints, rate=rate, at=at)


@dataclass
class FaultInjector:
    """Decides, request by request, which fault (if any) to inject, and counts them.

    Used only from the server's event loop, so it needs no locking.
    """

    spec: FaultSpec
    injected: Counter[str] = field(default_factory=Counter)
    """Injected faults by "kind" and by "kind@endpoint"."""
    _seen: list[int] = field(default_factory=list)
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._seen = [0] * len(self.spec.rules)
        self._rng = random.Random(self.spec.seed)

    def http_fault(self, endpoint: str) -> FaultRule | None:
        """The HTTP-level fault for this incoming request, if one fires."""
        if endpoint in NEVER_FAULTED:
            return None
        return self._decide(endpoint, HTTP_KINDS)

    def submit_fault(self, endpoint: str) -> bool:
        """True when the future created by this submission must fail (kind "fail")."""
        return self._decide(endpoint, frozenset({"fail"})) is not None

    def poll_fault(self, origin_endpoint: str) -> bool:
        """True when this retrieve_future poll must answer 410 (kind "410")."""
        return self._decide(origin_endpoint, frozenset({"410"})) is not None

    def _decide(self, endpoint: str, kinds: frozenset[str]) -> FaultRule | None:
        chosen: FaultRule | None = None
        for index, rule in enumerate(self.spec.rules):
            if rule.kind not in kinds or not rule.matches(endpoint):
                continue
            self._seen[index] += 1
            fires = self._seen[index] in rule.at if rule.at else self._rng.random() < rule.rate
            if fires and chosen is None:
                chosen = rule
        if chosen is not None:
            self.injected[chosen.kind] += 1
            self.injected[f"{chosen.kind}@{endpoint}"] += 1
        return chosen
