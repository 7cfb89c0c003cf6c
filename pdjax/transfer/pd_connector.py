"""What the prefill and decode connectors share: the data plane of one server and its plumbing.

A ``PDConnector`` is built by ``transfer.factory.create_kv_connection`` for
``--role prefill|decode`` and lives on the engine thread. It is two things at once: the
scheduler's ``KVConnector`` (``pdjax/sched/kv_connector.py``; the defaults below are what
neither role uses) and the engine's ``EngineRole`` (``pdjax/engine_roles.py``), and it sees the
engine only as a ``RoleHost``. Its worker's threads (ZMQ receiver, transfer, bootstrap,
heartbeat) report typed events through the worker's queue and wake the engine, which applies
every change to rooms, peers and the scheduler itself (DESIGN.md §4, "Threads and their
events"):

    engine thread: step() = role.poll() [drains the worker's events] -> worker.poll()
                            -> schedule -> forward -> sample -> worker.start(build_meta)
                            -> role.after_step()
    worker threads: event -> queue -> wake()

It is built from its parts (``PDParts``, made by ``build_pd_parts``) and owns them: the
transfer engine (``--disaggregation-transfer-backend``), this server's KV pool as
the engine sees it (``LocalKV``: direct or staging), the ``MetadataBuffers`` pool, the control
channel and the PD metrics. ``--disaggregation-transfer-path`` picks the KV path
(auto|direct|staging), ``--disaggregation-transfer-max-batch`` the most copies per engine
batch (default 1024, the Mooncake per-peer queue limit).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from pdjax.engine_io import GenerateOutput
from pdjax.engine_roles import RoleHost
from pdjax.pd.frame_auth import resolve_secret
from pdjax.pd.lifecycle import KVPoll
from pdjax.pd.protocol import Message
from pdjax.pd.wire import MAX_ROOM
from pdjax.request import FinishReason
from pdjax.transfer.channel import MessageChannel, advertise_host
from pdjax.transfer.engine import FAKE_BOOTSTRAP_HOST, create_transfer_engine
from pdjax.transfer.local_kv import LocalKV
from pdjax.transfer.metadata import MetadataBuffers
from pdjax.transfer.pd_metrics import PDMetrics

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20           # the HTTP API's limit; both roles must use the same row size
RECENT_ROOMS = 512              # concluded rooms kept for /pd_state
POLL_INTERVAL_S = 0.1           # timeouts are checked at least this often while rooms live


def check_room(room: Any, role: str) -> int:
    """``bootstrap_room`` of a PD request: an int in [1, 2**63). ``ValueError`` otherwise."""
    if room is None:
        raise ValueError(f"bootstrap_room: required on a {role} server (send requests through "
                         f"a PD router, or set bootstrap_host/bootstrap_port/bootstrap_room)")
    if isinstance(room, bool) or not isinstance(room, int) or not 1 <= room <= MAX_ROOM:
        raise ValueError(f"bootstrap_room: {room!r} outside [1, 2**63) (0 means unwritten)")
    return room


def error_output(rid: str, message: str, prompt_tokens: int = 0,
                 status_code: int | None = None) -> GenerateOutput:
    """The final output of a failed PD request; ``status_code`` None means 500."""
    return GenerateOutput(rid, [], finished=True, error=message, prompt_tokens=prompt_tokens,
                          finish_reason=FinishReason.abort(message, status_code))


def kv_head_repeat(host: RoleHost) -> int:
    """How often ``tp_model_config`` repeated each KV head of the checkpoint (1 = none).

    It replicates only when TP exceeds the checkpoint's KV heads, and then up to exactly
    ``tp_size`` heads, so the checkpoint is read only when the run has ``tp_size`` KV heads.
    """
    run_kvh = getattr(host.model_cfg, "num_kv_heads", None)
    tp = host.args.tp_size
    if not run_kvh or tp <= 1 or run_kvh != tp:
        return 1
    from pdjax.models.loader import checkpoint_config

    kvh = getattr(checkpoint_config(host.model_path), "num_kv_heads", run_kvh)
    return run_kvh // kvh if kvh and run_kvh % kvh == 0 else 1


@dataclasses.dataclass
class PDParts:
    """What a PD role is built from (``build_pd_parts``; a test passes fakes): the transfer
    engine (``--disaggregation-transfer-backend``), this server's KV pool as the engine sees it
    (``LocalKV``), the ``MetadataBuffers`` pool registered with the engine, and the control
    channel, bound but not yet reading (the role starts it once it can handle messages)."""

    transfer_engine: Any
    local_kv: Any
    meta: Any
    channel: Any


def resolve_transfer_backend(name: str, platform: str | None = None) -> str:
    """``--disaggregation-transfer-backend``: ``auto`` is ``jax`` on TPU (Mooncake has no TPU
    transport, and a TPU's tiled KV has no plain page addresses) and ``mooncake`` elsewhere
    (``platform``: JAX's default backend when None); any other name as given."""
    if name != "auto":
        return name
    if platform is None:
        import jax
        platform = jax.default_backend()
    return "jax" if platform == "tpu" else "mooncake"


def create_role_transfer_engine(args) -> Any:
    """The transfer engine of ``args`` (``--disaggregation-transfer-backend``, ``-max-batch``,
    ``--disaggregation-ib-device``) at this host's advertised address. ``ValueError`` for an
    unknown backend, ``ImportError`` when its library is missing."""
    kwargs: dict[str, Any] = {"max_batch": args.disaggregation_transfer_max_batch}
    backend = resolve_transfer_backend(args.disaggregation_transfer_backend)
    if backend != "fake" and args.disaggregation_ib_device:
        kwargs["device_name"] = args.disaggregation_ib_device
    if backend.startswith("jax"):          # pull-based: the decode's deadline per pull, at
        # most 60 s (a prefill offers one chunk at a time: a peer that never pulls holds up
        # its other transfers until then)
        kwargs["pull_timeout_s"] = min(60.0, args.transfer_timeout_s)
        kwargs["ack_slack_s"] = min(10.0, args.transfer_timeout_s)
        kwargs["secret"] = resolve_secret(args.disaggregation_secret)
    return create_transfer_engine(backend, advertise_host(args.host), **kwargs)


def build_pd_parts(host: RoleHost, role: str) -> PDParts:
    """The real parts of a ``role`` (``prefill``/``decode``) server on ``host``: they register
    the KV pool and the metadata rows with the transfer engine and bind the control socket.
    ``ValueError`` for an unknown backend, ``ImportError`` when its library is missing."""
    args = host.args
    engine = create_role_transfer_engine(args)
    if args.disaggregation_transfer_backend == "fake":
        logger.warning("PD %s: transfer backend 'fake' moves no KV bytes: decode outputs "
                       "are meaningless (control-plane testing only)", role)
    max_pages = -(-host.context_length // args.page_size)
    if hasattr(engine, "write_pages"):       # pull-based (jax): device arrays, no path
        from pdjax.transfer.jax_transfer_kv import JaxLocalKV
        local_kv = JaxLocalKV(host.runner, engine, max_pages, head_repeat=kv_head_repeat(host))
    else:
        local_kv = LocalKV(host.runner, engine, args.disaggregation_transfer_path, max_pages,
                           head_repeat=kv_head_repeat(host))
    local_kv.warmup()
    meta = MetadataBuffers(max(32, 8 * args.max_running_requests), MAX_TOP_LOGPROBS)
    meta.register(engine)
    channel = MessageChannel(args.host, None, role,
                             secret=resolve_secret(args.disaggregation_secret))
    return PDParts(engine, local_kv, meta, channel)


class PDConnector(abc.ABC):
    """Base of ``PrefillConnector`` and ``DecodeConnector`` (see the module docstring). A
    subclass calls ``start_channel()`` at the end of its constructor, once its worker exists."""

    role = ""

    def __init__(self, host: RoleHost, parts: PDParts):
        self.host = host
        self.args = host.args
        self.page_size = host.args.page_size
        self._count_lock = threading.Lock()      # the refused-message counters: any thread
        self._wake_cb: Callable[[], None] | None = None
        self._event = threading.Event()
        self._last_poll = 0.0
        self.metrics = PDMetrics(None, self.role)
        self.recent: collections.deque = collections.deque(maxlen=RECENT_ROOMS)
        self.num_rejected_messages = 0
        self.num_auth_rejected: dict[str, int] = {}
        # Control-plane authentication: the bootstrap writes and every ZMQ frame.
        self.secret = resolve_secret(self.args.disaggregation_secret)
        if self.secret is None:
            logger.warning("PD %s: no --disaggregation-secret (or PDJAX_DISAGGREGATION_SECRET): "
                           "the bootstrap server and the ZMQ control channel accept anyone who "
                           "can reach them", self.role)
        self.transfer_engine = parts.transfer_engine
        self.local_kv = parts.local_kv
        self.meta = parts.meta
        self.channel = parts.channel
        logger.info("PD %s: transfer backend %s (session %s), KV path %s, %d B per page over "
                    "%d layer buffers, control channel %s", self.role,
                    self.transfer_engine.backend, self.transfer_engine.session_id,
                    self.local_kv.mode, self.local_kv.bytes_per_page,
                    self.local_kv.num_layer_buffers, self.channel.endpoint)

    def start_channel(self) -> None:
        """Start reading the control channel (messages that came before wait in its socket)."""
        self.channel.start(self._on_message,
                           on_reject=lambda reason, kind: self.count_rejected(kind))

    # -- plumbing --------------------------------------------------------------------------
    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake()`` makes the engine thread run a step soon (set by ``AsyncEngine``)."""
        self._wake_cb = wake

    def wake(self) -> None:
        self._event.set()
        if self._wake_cb is not None:
            self._wake_cb()

    def attach_metrics(self, metrics) -> None:
        """Register the PD metrics on the server's ``pdjax.metrics.Metrics``."""
        self.metrics = PDMetrics(metrics, self.role)

    def count_rejected(self, kind: str = "malformed") -> None:
        """One refused control message; ``kind`` other than ``malformed`` / ``refused`` is an
        authentication failure (``hmac``, ``replay``, ``stale``, ``bootstrap``)."""
        with self._count_lock:
            self.num_rejected_messages += 1
            if kind not in ("malformed", "refused"):
                self.num_auth_rejected[kind] = self.num_auth_rejected.get(kind, 0) + 1
        self.metrics.on_rejected()
        if kind not in ("malformed", "refused"):
            self.metrics.on_auth_rejected(kind)

    def slots_in_use(self) -> int:
        """Metadata slots handed out (a finished server is back at 0)."""
        return self.meta.num_slots - self.meta.num_free

    def count_rooms(self, names: dict[KVPoll, str]) -> dict[str, int]:
        """How many of ``self.rooms`` (a subclass's dict of room records, each with a
        ``state``) are in each state that ``names`` maps to a queue name; every name is a key
        of the result, in the order of ``names`` (0 when no room is in its state)."""
        count = dict.fromkeys(names.values(), 0)
        for r in self.rooms.values():
            if r.state in names:
                count[names[r.state]] += 1
        return count

    @staticmethod
    def _check_new_request(req, room_rids) -> None:
        """``ValueError`` when the rid of ``req`` (a ``Request``) is in ``room_rids`` (the rids
        of this role's rooms; the engine checked the scheduler's and the context length)."""
        if req.rid in room_rids:
            raise ValueError(f"rid {req.rid!r} is already in use")

    def _set_state(self, r, state: KVPoll, now: float | None = None) -> None:
        """Move room ``r`` (with ``state`` and ``state_s``, when it entered it, monotonic s) to
        ``state`` at ``now`` (default: now), recording the time it spent in the old state;
        ``IllegalTransition`` when ``KVPoll.transition`` forbids the move."""
        now = time.monotonic() if now is None else now
        new = KVPoll.transition(r.state, state)
        self.metrics.on_state(r.state.name, now - r.state_s)
        r.state, r.state_s = new, now

    def baseline_load(self) -> dict[str, int]:
        """The counters every fault must leave at their baseline (``/get_load``)."""
        return {"num_free_pages": self.host.kv.allocator.num_free,
                "num_metadata_slots_used": self.slots_in_use()}

    def has_work(self) -> bool:
        """True when the engine thread has PD work now: an event arrived, or live rooms need
        their timeouts checked (at most every ``POLL_INTERVAL_S``)."""
        if self._event.is_set():
            return True
        return self.num_live_rooms() > 0 and time.monotonic() - self._last_poll >= POLL_INTERVAL_S

    def _begin_poll(self) -> float:
        self._event.clear()
        self._last_poll = time.monotonic()
        return self._last_poll

    def send(self, endpoint: str, msg: Message) -> bool:
        return self.channel.send(endpoint, msg)

    # -- KVConnector (pdjax/sched/kv_connector.py): what neither role uses -------------------
    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int | None:
        """0: the prompt is computed here (the prefill's requests)."""
        return 0

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        pass

    def build_meta(self, batch) -> Any:
        return None

    def request_finished(self, req) -> bool:
        return False

    def update(self, output) -> None:
        pass

    def owned_pages(self) -> list[int]:
        return []

    @property
    def num_quarantined_pages(self) -> int:
        return len(self.owned_pages())

    def update_gauges(self) -> None:
        c = self.transfer_engine.counters()
        self.metrics.set_state(self.queue_sizes(), c.largest_batch,
                               self.num_quarantined_pages,
                               self.host.num_prompt_tokens_computed())

    def base_state(self) -> dict[str, Any]:
        c = self.transfer_engine.counters()
        return {"role": self.role, "zmq_endpoint": self.channel.endpoint,
                "transfer_backend": self.transfer_engine.backend,
                "session_id": self.transfer_engine.session_id,
                "transfer_path": self.local_kv.mode,
                "kv_bytes_per_page": self.local_kv.bytes_per_page,
                "num_layer_buffers": self.local_kv.num_layer_buffers,
                "kv_shard_heads": [[list(h) for h in b.shard_heads]
                                   for b in self.local_kv.layout.buffers],
                "page_size": self.page_size, "num_pages": self.local_kv.num_pages,
                "max_batch": self.transfer_engine.max_batch,
                "engine": {"bytes": c.bytes, "copies": c.copies, "batches": c.batches,
                           "failures": c.failures, "largest_batch": c.largest_batch,
                           "seconds": c.seconds, "gbps": c.gbps},
                "num_address_changes": self.local_kv.num_address_changes,
                "num_rejected_messages": self.num_rejected_messages,
                "authenticated": self.secret is not None,
                "num_auth_rejected": dict(self.num_auth_rejected),
                "queues": self.queue_sizes(),
                "num_prompt_tokens_computed": self.host.num_prompt_tokens_computed(),
                "recent": list(self.recent)}

    def close_base(self) -> None:
        self.channel.close()
        try:
            self.meta.unregister(self.transfer_engine)
        except Exception:
            pass
        self.local_kv.close()
        self.transfer_engine.close()

    def on_rejected(self, g, message: str, status_code: int = 400) -> None:
        """This server refused the request ``g`` (a ``GenerateRequest``) before it reached the
        manager: ``reject_room`` for its room, unless it is the fake warm-up host."""
        if g.bootstrap_host != FAKE_BOOTSTRAP_HOST:
            self.reject_room(g.bootstrap_room, message, status_code)

    def reject_room(self, room: Any, message: str, status_code: int = 400) -> None:
        """This server refused the request for ``room`` (any value from a client): nothing to
        do by default (see ``PrefillConnector``)."""

    # -- to implement ------------------------------------------------------------------------
    @abc.abstractmethod
    def _on_message(self, msg: Message) -> None:
        """Role-specific; see PrefillConnector / DecodeConnector."""

    @abc.abstractmethod
    def num_live_rooms(self) -> int:
        """Role-specific; see PrefillConnector / DecodeConnector."""

    @abc.abstractmethod
    def queue_sizes(self) -> dict[str, int]:
        """Role-specific; see PrefillConnector / DecodeConnector."""
