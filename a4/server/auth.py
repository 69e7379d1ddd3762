"""API keys: with one set (`--api-key`, or the A4_API_KEY environment variable), every /v1/ route and /tokenize and
/detokenize need the header `Authorization: Bearer KEY` and answer 401 in OpenAI's error shape without it, before
reading the body. (vLLM keys only /v1/; the tokenizer routes run the server's tokenizer on the caller's input, work
that a server which asks for a key gives to keyed callers only.)

/health and /metrics stay open, as in vLLM: load balancers probe health and Prometheus scrapes metrics without keys,
and neither tells anything about the requests served.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from a4.server.errors import APIError

API_KEY_ENV = "A4_API_KEY"
PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = ("/tokenize", "/detokenize")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        protected = path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS
        if scope["type"] == "http" and protected and not self._authorized(scope):
            error = APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        # Constant time: how much of a guess matched must not show in the answer's timing.
        return hmac.compare_digest(given, self._expected)
