"""Names on the wire that the engine and its local server both use, beyond the MinT
protocol itself."""

from __future__ import annotations

from typing import Final

__all__ = ["LOCAL_MAX_NUM_SAMPLES", "LOCAL_PLACEHOLDER_KEY", "MAX_SEED", "RECOMMENDED_FIELD"]

RECOMMENDED_FIELD: Final = "engine_recommended"
"""The extra field of a model entry in ``get_server_capabilities`` with the RL settings
the local server recommends for that model (the SDK ignores it; hosted MinT omits it)."""

LOCAL_PLACEHOLDER_KEY: Final = "tml-engine-local"
"""The API key a client sends to a local server started without one (the SDK refuses
to connect without a key; such a server accepts any)."""

MAX_SEED: Final = 2**63 - 1
"""Seeds are sent to the server as signed 64-bit integers: 0..MAX_SEED."""

LOCAL_MAX_NUM_SAMPLES: Final = 128
"""The most samples of one prompt the local server draws per asample request (its
``Limits.max_num_samples`` default)."""
