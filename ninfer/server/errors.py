"""The error every OpenAI endpoint raises for a client-visible failure: an HTTP status and the
OpenAI error envelope."""
from __future__ import annotations

from typing import Any

from ninfer.server.protocol import ErrorInfo, ErrorResponse

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error that becomes an OpenAI error envelope with HTTP status `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or _ERROR_TYPES.get(status, "APIError")

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.status)).model_dump()
