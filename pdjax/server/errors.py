"""The error every request parser raises for bad input (HTTP 400 unless stated)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status, ``param`` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
