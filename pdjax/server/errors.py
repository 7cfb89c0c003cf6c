"""The error every request parser raises for bad input (HTTP 400 unless stated), and the JSON
body every error answer carries (the servers' and the PD router's)."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status, ``param`` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def error_body(message: str, status: int, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    """OpenAI-style error JSON: ``{"error": {"message", "type", "param", "code"}}``; ``type``
    from the status unless given (the router's own errors: ``router_error``)."""
    if err_type is None:
        err_type = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 503: "service_unavailable"}.get(
                        status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}
