"""The one place a KV connection is built: ``--role`` or ``--kv-connector`` -> the connector the
scheduler calls, the worker the engine polls, and the role the engine hands requests to
(DESIGN.md §4).

``register_kv_connector(name, factory)`` adds a connector (a test's file-backed one, say);
``--kv-connector NAME`` on a colocated server picks it. The PD roles are built in: each is one
object that is both the connector and the ``EngineRole``, with its own worker
(``PrefillTransferWorker``, ``DecodeTransferWorker``). A colocated server gets the null
connection: ``NullConnector``, ``NullWorker``, ``NullRole``; an engine's connection is never
None.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from pdjax.engine_roles import EngineRole, NullRole, RoleHost
from pdjax.sched.kv_connector import KVConnector, NullConnector
from pdjax.transfer.worker import KVTransferWorker, NullWorker


@dataclasses.dataclass
class KVConnection:
    """What ``EngineCore`` plugs in: ``connector`` goes to the scheduler, ``worker`` is polled
    and started every step, ``role`` sees requests first, answers aborts and reports its load
    (``NullRole``: the scheduler takes every request)."""

    connector: KVConnector = dataclasses.field(default_factory=NullConnector)
    worker: KVTransferWorker = dataclasses.field(default_factory=NullWorker)
    role: EngineRole = dataclasses.field(default_factory=NullRole)


_REGISTRY: dict[str, Callable[[RoleHost], KVConnection]] = {}


def register_kv_connector(name: str, factory: Callable[[RoleHost], KVConnection]) -> None:
    """Make ``--kv-connector name`` build ``factory(host)`` (``host``: the engine as a
    ``RoleHost``); ``ValueError`` for a taken name."""
    if name in _REGISTRY:
        raise ValueError(f"kv_connector {name!r} is already registered")
    _REGISTRY[name] = factory


def unregister_kv_connector(name: str) -> None:
    _REGISTRY.pop(name, None)


def available_kv_connectors() -> tuple[str, ...]:
    """The names ``--kv-connector`` accepts."""
    return tuple(sorted(_REGISTRY))


def check_kv_connector(name: str | None) -> None:
    """``ValueError`` naming ``kv_connector`` and the known names when ``name`` (None: none)
    is not registered (serve's parse step and ``pdjax.Engine`` call it before loading)."""
    if name is not None and name not in _REGISTRY:
        raise ValueError(f"kv_connector: {name!r} is not registered (known: "
                         f"{', '.join(available_kv_connectors()) or 'none'})")


def create_kv_connection(host: RoleHost) -> KVConnection:
    """The connection of ``host.args``: the PD role of ``--role prefill|decode``
    (``PrefillConnector``, ``DecodeConnector``: they bind sockets and start threads, imported
    here on first use so that ZMQ and aiohttp stay out of a colocated engine), the registered
    ``--kv-connector``, or the null connection (colocated). ``ValueError`` for a connector next
    to a PD role or an unknown connector name."""
    role = host.args.role
    name = getattr(host.args, "kv_connector", None)
    if name is not None and role in ("prefill", "decode"):
        raise ValueError(f"kv_connector {name!r}: only on a colocated server (role {role!r} "
                         f"is a connector itself)")
    if name is not None:
        check_kv_connector(name)
        return _REGISTRY[name](host)
    if role not in ("prefill", "decode"):
        if getattr(host.args, "enable_hierarchical_cache", False):
            from pdjax.kv.hicache.worker import build_host_tier    # HiCache's host tier
            return KVConnection(*build_host_tier(host))
        return KVConnection()
    from pdjax.transfer.pd_connector import build_pd_parts

    if role == "prefill":
        from pdjax.transfer.prefill import PrefillConnector as Connector
    else:
        from pdjax.transfer.decode import DecodeConnector as Connector
    pd = Connector(host, build_pd_parts(host, role))
    if role == "prefill" and getattr(host.args, "enable_hierarchical_cache", False):
        from pdjax.kv.hicache.pd import with_host_tier     # HiCache's tiers behind the prefill
        return KVConnection(*with_host_tier(host, pd))
    return KVConnection(pd, pd.worker, pd)
