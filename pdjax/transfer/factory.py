"""The one place a KV connector is built: ``--role`` or ``--kv-connector`` -> the connector the
scheduler calls, the worker the engine polls, and the PD role the engine hands requests to.

``pdjax.sched.kv_connector.register_kv_connector(name, factory)`` adds a connector (a test's
file-backed one, say);
``--kv-connector NAME`` on a colocated server picks it. The PD roles are built in: each is one
object that is both the connector and the ``EngineRole``, with its own worker
(``PrefillTransferWorker``, ``DecodeTransferWorker``).
"""

from __future__ import annotations

from pdjax.engine_roles import RoleHost
from pdjax.sched.kv_connector import KVConnection, kv_connector_factory


def create_kv_connection(host: RoleHost) -> KVConnection | None:
    """The connection of ``host.args``: the PD role of ``--role prefill|decode``
    (``PrefillConnector``, ``DecodeConnector``: they bind sockets and start threads, imported
    here on first use so that ZMQ and aiohttp stay out of a colocated engine), the registered
    ``--kv-connector``, or None (colocated: the scheduler's ``NullConnector``). ``ValueError``
    for a connector next to a PD role."""
    role = host.args.role
    name = getattr(host.args, "kv_connector", None)
    if name is not None and role in ("prefill", "decode"):
        raise ValueError(f"kv_connector {name!r}: only on a colocated server (role {role!r} "
                         f"is a connector itself)")
    if name is not None:
        return kv_connector_factory(name)(host)
    if role == "prefill":
        from pdjax.transfer.prefill import PrefillConnector
        from pdjax.transfer.role import build_role_parts

        pd = PrefillConnector(host, build_role_parts(host, role))
        return KVConnection(pd, pd.worker, pd)
    if role == "decode":
        from pdjax.transfer.decode import DecodeConnector
        from pdjax.transfer.role import build_role_parts

        pd = DecodeConnector(host, build_role_parts(host, role))
        return KVConnection(pd, pd.worker, pd)
    return None
