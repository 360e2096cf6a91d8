"""Network rules the engine and its local server share."""

from __future__ import annotations

import ipaddress
from typing import Final

__all__ = ["LOOPBACK_NAMES", "is_loopback_host"]

LOOPBACK_NAMES: Final = frozenset({"localhost"})


def is_loopback_host(host: str) -> bool:
    """True for names/addresses that only this machine can reach."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
