"""Service profiles: the local server behaving as a hosted service does (``--service``).

A profile changes only what changes a client's results or its control flow: which losses
and ``loss_fn_config`` keys are accepted (the rest refused with a 400 naming them), whether
``create_model`` takes MinT's ``rollout_correction_config``, and the default number of
sampling slots (``engine.local.operations.sampling_gate``). ``local`` is the engine's own server:
every loss and option of ``engine.local.compute.losses``, no sampling limit. Sources of each
behaviour: docs/local-server.md, "Service profiles". Metadata only (no torch): the CLI
reads it before loading anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["SERVICES", "ServiceProfile", "ServiceRefusal", "profile_of"]


class ServiceRefusal(ValueError):
    """A request the emulated service refuses (answered 400, naming what it refuses)."""


@dataclass(frozen=True)
class ServiceProfile:
    name: str
    losses: Mapping[str, frozenset[str]] | None
    """Accepted loss_fn -> accepted loss_fn_config keys; None: every local loss and key."""
    rollout_correction: bool
    """Whether create_model takes ``rollout_correction_config`` (MinT's session-level
    correction, ``engine.local.compute.rollout_correction``)."""
    sampling_slots: int | None
    """Default of ``--sampling-slots``: sample requests run at a time (None: no limit)."""
    seq_id_optional: bool = False
    """A training operation without a seq_id takes its model's next one (MinT's own
    validate_mis_rollout_correction.py sends none); otherwise it is refused."""

    def check_loss(self, loss_fn: str, config: Mapping[str, object] | None) -> None:
        """ServiceRefusal unless this service accepts ``loss_fn`` with ``config``."""
        if self.losses is None:
            return
        accepted = self.losses.get(loss_fn)
        if accepted is None:
            raise ServiceRefusal(
                f"loss_fn {loss_fn!r} is not supported by this server (--service {self.name}); "
                f"supported: {', '.join(sorted(self.losses))}"
            )
        refused = sorted(set(config or {}) - accepted)
        if refused:
            raise ServiceRefusal(
                f"loss_fn_config key(s) {', '.join(map(repr, refused))} are not accepted by "
                f"loss_fn {loss_fn!r} on this server (--service {self.name}; accepted: "
                f"{', '.join(sorted(accepted)) or 'none'})"
            )


_CLIP = frozenset({"clip_low_threshold", "clip_high_threshold"})
HOSTED_SAMPLING_SLOTS: Final = 8
"""Sample requests a hosted profile runs at a time unless ``--sampling-slots`` says
otherwise: neither service publishes its capacity, so this is the local server's choice,
small enough that an RL step's fan-out (one request per problem) queues."""

_PROFILES: Final = {
    "local": ServiceProfile("local", None, rollout_correction=True, sampling_slots=None),
    # MinT's API reference (mint-quickstart mint-skill/mint_api_reference.txt) and the
    # mint SDK's LossFnType: five losses, ppo/cispo clip thresholds and dro's beta.
    "mint": ServiceProfile(
        "mint",
        {
            "cross_entropy": frozenset(),
            "importance_sampling": frozenset(),
            "ppo": _CLIP,
            "cispo": _CLIP,
            "dro": frozenset({"beta"}),
        },
        rollout_correction=True,
        sampling_slots=HOSTED_SAMPLING_SLOTS,
        seq_id_optional=True,
    ),
    # tinker 0.38's LossFnType and the hosted docs (tinker-docs.thinkingmachines.ai, "Loss
    # functions"): gspo and stable_reinforce too; stable_reinforce takes kl_coeff.
    "tinker": ServiceProfile(
        "tinker",
        {
            "cross_entropy": frozenset(),
            "importance_sampling": frozenset(),
            "ppo": _CLIP,
            "cispo": _CLIP,
            "dro": frozenset({"beta"}),
            "gspo": _CLIP,
            "stable_reinforce": frozenset({"kl_coeff"}),
        },
        rollout_correction=False,
        sampling_slots=HOSTED_SAMPLING_SLOTS,
    ),
}
SERVICES: Final = tuple(_PROFILES)


def profile_of(name: str) -> ServiceProfile:
    return _PROFILES[name]
