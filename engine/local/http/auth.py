"""API-key and JWT authentication.

The pinned client only accepts ``sk-`` (MinT) keys in JWT mode: it sends the raw key to
``client/config`` and ``auth/token``, receives a JWT, and sends that JWT as ``X-API-Key``
from then on. So the server always announces JWT mode, accepts the raw key or a JWT it
issued, and signs JWTs with a secret derived from the key: tokens stay valid across a
restart with the same key, and change when the key does. Keys are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable

import jwt

_ISSUER = "engine.local"
_SECRET_LABEL = b"engine.local jwt v1"

VERIFIED_TOKENS_KEPT = 64
"""JWTs whose signature was checked, kept with their expiry so later requests bearing
them skip the decode (PyJWT's decode cost the event loop ~0.3 ms per request)."""


class Authenticator:
    """Checks credentials when an API key is configured; accepts anything otherwise."""

    def __init__(
        self, api_key: str | None, *, jwt_ttl_s: int, clock: Callable[[], float] = time.time
    ) -> None:
        self._api_key = api_key
        self._ttl = jwt_ttl_s
        self._clock = clock
        self._verified: OrderedDict[str, int] = OrderedDict()
        """Tokens this server issued and verified, oldest first, with their ``exp``."""
        material = (api_key or "").encode()
        self._secret = hmac.new(_SECRET_LABEL, material, hashlib.sha256).digest()

    @property
    def required(self) -> bool:
        return self._api_key is not None

    def issue(self) -> str:
        """A signed JWT with a numeric ``exp`` (the client refreshes 5 min before it)."""
        now = int(self._clock())
        claims = {"iss": _ISSUER, "sub": "local-user", "iat": now, "exp": now + self._ttl}
        return jwt.encode(claims, self._secret, algorithm="HS256")

    def may_issue(self, credential: str | None) -> bool:
        """Whether ``credential`` may fetch a JWT: only the API key itself can, so a
        leaked JWT cannot be renewed forever."""
        return self._api_key is None or (
            credential is not None
            and hmac.compare_digest(credential.encode(), self._api_key.encode())
        )

    def check(self, credential: str | None) -> str | None:
        """None when the credential is acceptable, else a one-line reason."""
        if self._api_key is None:
            return None
        if not credential:
            return "missing API key: send it in the X-API-Key header"
        if self.may_issue(credential):
            return None
        expired = "the JWT has expired: fetch a new one from /api/v1/auth/token"
        exp = self._verified.get(credential)
        if exp is not None:
            if self._clock() < exp:
                return None
            del self._verified[credential]
            return expired
        if credential.count(".") == 2:
            try:
                claims = jwt.decode(
                    credential,
                    self._secret,
                    algorithms=["HS256"],
                    issuer=_ISSUER,
                    options={"require": ["exp", "iss"]},
                )
            except jwt.ExpiredSignatureError:
                return expired
            except jwt.InvalidTokenError:
                return "invalid JWT: it was not issued by this server for this API key"
            self._verified[credential] = int(claims["exp"])
            if len(self._verified) > VERIFIED_TOKENS_KEPT:
                self._verified.popitem(last=False)
            return None
        return "invalid API key"
