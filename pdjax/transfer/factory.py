"""The one place a PD role is built: ``--role`` -> the manager that plugs into the engine."""

from __future__ import annotations

from pdjax.engine_roles import EngineRole, RoleHost


def create_engine_role(host: RoleHost) -> EngineRole | None:
    """The ``EngineRole`` of ``host.args.role`` (``prefill``: ``PrefillManager``, ``decode``:
    ``DecodeManager``), or None for a colocated engine. The managers bind sockets and start
    threads (imported here, on first use: ZMQ and aiohttp stay out of a colocated engine)."""
    role = host.args.role
    if role == "prefill":
        from pdjax.transfer.prefill import PrefillManager

        return PrefillManager(host)
    if role == "decode":
        from pdjax.transfer.decode import DecodeManager

        return DecodeManager(host)
    return None
