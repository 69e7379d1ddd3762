"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, as the routes and guards answer them."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from a4.server.protocol import ErrorInfo, ErrorResponse

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error response: status, and the fields of OpenAI's error object."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.headers = status, headers
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), self.status, headers=self.headers)


def unavailable(message: str) -> APIError:
    """503 with Retry-After: the server takes no request now (busy, or shutting down); the client may retry."""
    return APIError(503, message, type="server_error", code="server_busy",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})  # fmt: skip
