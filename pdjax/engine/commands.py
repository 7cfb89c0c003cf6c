"""The commands the server's thread sends to the engine thread (``AsyncEngine``'s inbox).

Typed, frozen dataclasses; each runs on the engine thread between two steps. ``_call_sync``
commands answer (``FlushCache`` -> bool, ``GetLoad`` / ``GetPDState`` -> dict, the profile
commands -> the trace folder); the others answer through the request's output stream.
"""

from __future__ import annotations

import dataclasses

from pdjax.engine_io import GenerateRequest


@dataclasses.dataclass(frozen=True)
class AddRequest:
    """Queue ``req``; a bad one gets a final output with a 400 error at once."""

    req: GenerateRequest


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    """Drop ``rid`` wherever it is (its pages come back); its stream gets a final output."""

    rid: str


@dataclasses.dataclass(frozen=True)
class RejectRooms:
    """PD prefill: the HTTP server refused a request for these bootstrap rooms before it
    reached the engine; fail the rooms and tell their decode (HTTP ``status_code``)."""

    rooms: tuple[int, ...]
    message: str
    status_code: int = 400


@dataclasses.dataclass(frozen=True)
class FlushCache:
    pass


@dataclasses.dataclass(frozen=True)
class GetLoad:
    pass


@dataclasses.dataclass(frozen=True)
class GetPDState:
    pass


@dataclasses.dataclass(frozen=True)
class StartProfile:
    output_dir: str
    num_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class StopProfile:
    pass


Command = (AddRequest | AbortRequest | RejectRooms | FlushCache | GetLoad | GetPDState
           | StartProfile | StopProfile)
