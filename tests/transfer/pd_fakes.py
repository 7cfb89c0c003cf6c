"""Parts for building the PD connectors in one process, without a model or sockets:
``KVRunner`` (a runner's KV-page methods over random buffers), ``FakeChannel`` (records what
is sent; answers a registration at once), ``FakeHost`` (the engine as a ``RoleHost``) and
``decode_connector`` (a ``DecodeConnector`` over them and a real scheduler)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax.numpy as jnp
import numpy as np

from pdjax.config import ServerArgs
from pdjax.engine_roles import RoleHost
from pdjax.engine_io import GenerateOutput
from pdjax.models.cache_spec import gqa_cache_spec
from pdjax.pd.protocol import RegisterDecode, RegisterResult
from pdjax.runner.entry_points import EntryPoints
from pdjax.models.loader import make_mesh
from pdjax.runner.model_runner import ModelRunner
from pdjax.sched.scheduler import Scheduler, SchedulerConfig
from pdjax.transfer.fake import FakeTransferEngine
from pdjax.transfer.local_kv import LocalKV
from pdjax.transfer.metadata import MetadataBuffers
from pdjax.transfer.pd_connector import MAX_TOP_LOGPROBS, PDParts


class KVRunner(ModelRunner):
    """The runner's KV-page methods over two random buffers (no model).
    ``shape``: ``[layers, pages, page_size, kv_heads, head_dim]``."""

    def __init__(self, shape, dtype=jnp.float32):
        L, N, ps, h, d = shape
        self.cache_specs = gqa_cache_spec(L, h, d, num_pages=N, page_size=ps, dtype=dtype)
        self.jits = EntryPoints(None, make_mesh(1), self.cache_specs, max_rows=1, vocab_size=1,
                                page_size=ps)
        rng = np.random.default_rng(0)
        self.caches = {s.name: jnp.asarray(rng.standard_normal(s.shape), dtype)
                       for s in self.cache_specs}
        self.kv_copying, self.in_place_kv_required = {}, False
        self._kv_copy_lock = threading.Lock()


class FakeChannel:
    """A control channel that records ``(endpoint, message)`` in ``sent`` and answers every
    ``RegisterDecode`` with ``RegisterResult(accepted=accept)`` through the started handler
    (as the prefill would, on the channel's receiver thread)."""

    host, port = "127.0.0.1", 1
    endpoint = "tcp://127.0.0.1:1"

    def __init__(self, accept: bool = True):
        self.accept = accept
        self.sent: list = []
        self.dropped: list[str] = []
        self.handler = None

    def start(self, handler, on_reject=None) -> None:
        self.handler = handler

    def send(self, endpoint: str, msg) -> bool:
        self.sent.append((endpoint, msg))
        if isinstance(msg, RegisterDecode):
            self.handler(RegisterResult(decode_engine_id=msg.decode_engine_id,
                                        accepted=self.accept, reason="" if self.accept else "no"))
        return True

    def drop_peer(self, endpoint: str) -> None:
        self.dropped.append(endpoint)

    def close(self) -> None:
        pass


def fake_host(args: ServerArgs, scheduler: Scheduler, runner, vocab_size: int = 512) -> RoleHost:
    """The engine as a PD role sees it (``pdjax.engine_roles.RoleHost``) over a real
    ``scheduler`` and no forward."""
    cfg = type("Cfg", (), {"vocab_size": vocab_size, "num_kv_heads": 2})()
    return RoleHost(args=args, model_path="fake", model_cfg=cfg,
                    context_length=scheduler.max_request_tokens, runner=runner, kv=scheduler.kv,
                    wait_for_device=lambda: None, wait_for_kv=lambda: None,
                    abort_request=scheduler.abort_request,
                    num_prompt_tokens_computed=lambda: scheduler.num_prompt_tokens_computed)


def make_output(req) -> GenerateOutput:
    """What the engine streams for ``req``'s change (its tokens so far; a request stops only
    at ``max_new_tokens`` here)."""
    return GenerateOutput(req.rid, list(req.output_ids), finished=req.is_finished,
                          prompt_tokens=req.num_prompt_tokens, error=req.error,
                          finish_reason=req.finish_reason if req.is_finished else None)


@dataclasses.dataclass
class DecodeUnderTest:
    """A ``DecodeConnector`` (``conn``) over fake parts, its ``channel`` and the real
    ``scheduler`` it is the connector of, driven as ``EngineCore`` drives them, without a
    forward: ``add``, ``abort`` and ``step``."""

    conn: Any
    channel: FakeChannel
    scheduler: Scheduler

    def add(self, g, req) -> None:
        """``EngineCore.add_request``: the scheduler's checks, the role opens the room, the
        scheduler queues the request."""
        self.scheduler.check_new_request(req)
        self.conn.add_request(g, req)
        self.scheduler.add_request(req)

    def abort(self, rid: str, message: str) -> None:
        """``EngineCore.abort_request`` (the scheduler's abort)."""
        assert self.conn.abort(rid, message) is None
        self.scheduler.abort_request(rid, message)

    def step(self) -> list[GenerateOutput]:
        """The step around the role: its ``poll``, the scheduler's ``update_from_kv_output``
        of the worker's report (a request's first token, or its error: one output each) and
        ``schedule`` (the admission path). Returns the outputs the engine would stream."""
        outputs = list(self.conn.poll())
        for req in self.scheduler.update_from_kv_output(self.conn.worker.poll(),
                                                        lambda req: None):
            outputs.append(make_output(req))
        self.scheduler.schedule()
        return self.conn.after_step(None, outputs)


def decode_connector(page_size: int = 4, num_pages: int = 17, channel: FakeChannel | None = None,
                     **args) -> DecodeUnderTest:
    """A ``DecodeConnector`` over fake parts (fake transfer backend: no metadata gate) and a
    real ``Scheduler`` of ``num_pages`` pages; ``args`` go to ``ServerArgs``. Close its
    ``conn`` when done."""
    from pdjax.transfer.decode import DecodeConnector

    runner = KVRunner((2, num_pages, page_size, 2, 8))
    engine = FakeTransferEngine()
    local_kv = LocalKV(runner, engine, "direct", max_pages_per_seq=num_pages - 1)
    meta = MetadataBuffers(32, MAX_TOP_LOGPROBS)
    channel = channel or FakeChannel()
    server_args = ServerArgs(role="decode", page_size=page_size,
                             max_total_tokens=(num_pages - 1) * page_size,
                             disaggregation_transfer_backend="fake", **args)
    scheduler = Scheduler(SchedulerConfig(num_pages=num_pages, page_size=page_size,
                                          max_running_requests=4, chunked_prefill_size=16,
                                          num_reserved_decode_tokens=8))
    conn = DecodeConnector(fake_host(server_args, scheduler, runner),
                           PDParts(engine, local_kv, meta, channel))
    scheduler.connector = conn
    return DecodeUnderTest(conn, channel, scheduler)


def prefill_worker(**parts):
    """A ``PrefillTransferWorker`` (its thread running: close it) over ``parts``, each
    defaulting to a fake: a ``FakeChannel``, no local KV, metadata, engine or ranks, page size
    4, no-op ``wait_for_kv`` / ``wake`` / ``on_reject``."""
    from pdjax.transfer.prefill_worker import PrefillTransferWorker

    kwargs = dict(channel=FakeChannel(), local_kv=None, meta=None, transfer_engine=None,
                  ranks=None, page_size=4, transfer_timeout_s=5.0, sender_id="prefill@test",
                  wait_for_kv=lambda: None, wake=lambda: None, on_reject=lambda kind: None)
    kwargs.update(parts)
    return PrefillTransferWorker(**kwargs)
