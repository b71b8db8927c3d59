"""API keys for the server (``--api-key``, vLLM's flag; ``JDSPARK_API_KEY``): every request but the operators'
probes must carry ``Authorization: Bearer <key>`` with one of the keys, else a 401 in OpenAI's error body
(``invalid_api_key``; OpenAI clients raise their AuthenticationError on it).

Open without a key: ``/health``, ``/ping``, ``/version`` (a load balancer's probes) and ``/metrics`` (Prometheus),
and any ``OPTIONS`` (CORS preflight), as vLLM leaves them. Unlike vLLM, which checks only paths under ``/v1``,
``/tokenize`` and ``/detokenize`` need a key too: every route that reads the model's vocabulary or runs it.

A pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one runs the app in a task of its own, which
hides a client's disconnect from a streaming response (the server frees a slot on it). Keys are compared as SHA-256
digests with ``hmac.compare_digest`` (the time taken does not depend on where a wrong key differs), every key
checked whatever the first gave."""

from __future__ import annotations

import hashlib
import hmac
from typing import Sequence

from jdspark.serve_errors import ApiError

__all__ = ["OPEN_PATHS", "ApiKeys"]

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    """ASGI middleware: the wrapped app answers only requests that carry one of ``keys`` (none empty)."""

    def __init__(self, app, keys: Sequence[str]):
        if not keys or any(not isinstance(k, str) or not k.strip() for k in keys):
            raise ValueError("api keys: expected one or more non-empty strings")
        self.app, self._digests = app, [_digest(k) for k in keys]

    def allowed(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header's value is ``Bearer <one of the keys>``."""
        scheme, _, token = authorization.partition(" ")
        given = _digest(token.strip())
        match = False
        for d in self._digests:
            match |= hmac.compare_digest(given, d)
        return scheme.lower() == "bearer" and match

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.allowed(headers.get(b"authorization", b"").decode("latin-1")):
            return await self.app(scope, receive, send)
        answer = ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with a key this "
                               "server was started with (--api-key)", type_="invalid_request_error",
                          code="invalid_api_key").response()
        await answer(scope, receive, send)
