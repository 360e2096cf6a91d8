"""Names on the wire that the engine and its local server both use, beyond the MinT
protocol itself."""

from __future__ import annotations

from typing import Any, Final

__all__ = [
    "LOCAL_MAX_NUM_SAMPLES",
    "LOCAL_PLACEHOLDER_KEY",
    "MAX_SEED",
    "RECOMMENDED_FIELD",
    "ROLLOUT_CORRECTIONS",
]

RECOMMENDED_FIELD: Final = "engine_recommended"
"""The extra field of a model entry in ``get_server_capabilities`` with the RL settings
the local server recommends for that model (the SDK ignores it; hosted MinT omits it)."""

LOCAL_PLACEHOLDER_KEY: Final = "tml-engine-local"
"""The API key a client sends to a local server started without one (the SDK refuses
to connect without a key; such a server accepts any)."""

MAX_SEED: Final = 2**63 - 1
"""Seeds are sent to the server as signed 64-bit integers: 0..MAX_SEED."""

ROLLOUT_CORRECTIONS: Final[dict[str, dict[str, Any]]] = {
    "mis": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 1.1,
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.5_2.0",
        "bypass_mode": True,
        "loss_type": "reinforce",
    },
}
"""MinT's session-level rollout corrections by the name ``--rollout-correction`` gives
them: the ``rollout_correction_config`` ``create_model`` carries. ``mis``: the one MinT's
quickstart sends (MindLab-Research/mint-quickstart, docs/mis_rollout_correction.md and
advanced/validate_mis_rollout_correction.py): sequence-level importance weights truncated
at 1.1, sequences whose summed log ratio leaves [log 0.5, log 2] rejected, REINFORCE on
the sampled tokens (verl's bypass mode)."""

LOCAL_MAX_NUM_SAMPLES: Final = 128
"""The most samples of one prompt the local server draws per asample request (its
``Limits.max_num_samples`` default)."""
