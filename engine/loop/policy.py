"""The policy-version board: how the trainer hands new samplers back to the sampler stage.

Why a separate object: data flows one way (problems -> sampler -> scorer -> trainer);
the only thing that flows back is "a newer policy exists". The trainer publishes each
new sampler snapshot here; the sampler stage reads the newest one and waits here for
admission (``wait_for(step - K)``). Nothing else is shared between the stages but
:class:`Watermark`, the count of steps the trainer has submitted.
"""

from __future__ import annotations

import anyio

from engine.session.api import SamplerHandle

__all__ = ["PolicyVersions", "Watermark"]


class PolicyVersions:
    """The newest sampler snapshot, and a way to wait for a given version."""

    def __init__(self, initial: SamplerHandle) -> None:
        self._current = initial
        self._changed = anyio.Event()

    @property
    def current(self) -> SamplerHandle:
        return self._current

    def publish(self, handle: SamplerHandle) -> None:
        """Make ``handle`` the newest policy; versions only move forward."""
        if handle.version <= self._current.version:
            raise ValueError(
                f"sampler version {handle.version} published after {self._current.version}"
            )
        self._current = handle
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, version: int) -> SamplerHandle:
        """The newest snapshot once its version is at least ``version``."""
        while self._current.version < version:
            await self._changed.wait()
        return self._current


class Watermark:
    """A count that only moves forward, published by one stage and awaited by another
    (the steps the submitter has submitted, for ``--sample-ahead``)."""

    def __init__(self, value: int) -> None:
        self._value = value
        self._changed = anyio.Event()

    async def wait_for(self, value: int) -> None:
        while self._value < value:
            await self._changed.wait()

    def reached(self, value: int) -> None:
        self._value = value
        self._changed.set()
        self._changed = anyio.Event()
