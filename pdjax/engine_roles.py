"""The seam between the engine and a PD role (DESIGN.md §1 "Layers", §4).

``EngineCore`` runs the same step for every role; a PD role (``--role prefill|decode``) plugs
in through ``EngineRole``, which the engine calls at fixed points, and sees the engine only
through a ``RoleHost``, which ``EngineCore`` builds before its scheduler (no scheduler, no
model runner beyond its KV methods). Neither side reaches into the other's privates. The scheduler calls the same object as its ``KVConnector``
(``pdjax/sched/kv_connector.py``): a decode's requests are admitted by the scheduler like any
other, the role answering ``get_num_new_matched_tokens`` and its worker reporting the KV in.

One engine step and where the role is called (engine thread)::

    step():  [read a grammar step in flight]
             role.poll()                      -> outputs   (events, gates, timeouts)
             scheduler.update_from_kv_output(worker.poll())     (KV in or failed, held
                                                                 pages back)
             scheduler.schedule() -> launch -> read a step's tokens
             worker.start(connector.build_meta(batch))          (queue KV chunks)
             role.after_step(batch, outputs)  -> outputs   (hold answers, address checks)
    add_request(g): role.add_request(g, req)  (its room), then scheduler.add_request(req):
                                              one queue; the connector answers "not yet"
                                              until the room is ready
    abort_request:  role.abort(rid, message)  -> an output, or None: the scheduler's
    a request refused before it reached the role: role.on_rejected / role.reject_room
    has_work:       role.has_work()           (events from its helper threads, timeouts)
    get_load / /pd_state: role.load(), role.debug_state()
    AsyncEngine:    role.set_wake(wake), role.attach_metrics(metrics), role.close() at the end

Pure Python (typing only): both sides import it, the engine from above, the roles from below.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:      # annotations only: no import at run time
    from pdjax.config import ServerArgs
    from pdjax.engine_io import GenerateOutput, GenerateRequest
    from pdjax.request import Request
    from pdjax.sched.scheduled_batch import ScheduledBatch


@runtime_checkable
class EngineRole(Protocol):
    """A PD role as the engine sees it (``PrefillConnector``, ``DecodeConnector``). Every method
    runs on the engine thread; a role's own threads only record events and call the wake
    callback."""

    def add_request(self, g: GenerateRequest, req: Request) -> None:
        """Open the role's record of ``req`` (a PD room) before the scheduler queues it;
        ``ValueError`` naming the field for a bad PD request (nothing is kept then)."""

    def has_work(self) -> bool:
        """Whether the engine should step now for the role's sake."""

    def poll(self) -> list[GenerateOutput]:
        """Before scheduling: apply the helper threads' events, admit, commit, time out."""

    def after_step(self, batch: ScheduledBatch | None,
                   outputs: list[GenerateOutput]) -> list[GenerateOutput]:
        """After a step's results were read (``batch`` None: no forward was read): returns the
        outputs to stream (a role may hold some back, e.g. until a transfer ends)."""

    def abort(self, rid: str, message: str) -> GenerateOutput | None:
        """A client abort; None when ``rid`` is not the role's (the scheduler's then)."""

    def on_rejected(self, g: GenerateRequest, message: str, status_code: int = 400) -> None:
        """``add_request`` refused ``g``: tell the peer at once."""

    def reject_room(self, room: Any, message: str, status_code: int = 400) -> None:
        """The HTTP server refused the request for ``room`` (any client value)."""

    def load(self) -> dict[str, Any]:
        """The role's fields of ``/get_load``."""

    def debug_state(self) -> dict[str, Any]:
        """``/pd_state``: rooms, peers, transfer records."""

    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake()`` makes the engine thread step soon."""

    def attach_metrics(self, metrics: Any) -> None:
        """Register the role's metrics on the server's ``pdjax.metrics.Metrics``."""

    def close(self) -> None:
        """Stop the role's threads and sockets (engine shutdown)."""


class NullRole:
    """The ``EngineRole`` of a server that is no PD role (colocated, or a ``--kv-connector``
    one): it takes no request, has no work, reports no load of its own."""

    def add_request(self, g, req) -> None:
        pass

    def has_work(self) -> bool:
        return False

    def poll(self) -> list:
        return []

    def after_step(self, batch, outputs: list) -> list:
        return outputs

    def abort(self, rid: str, message: str):
        return None

    def on_rejected(self, g, message: str, status_code: int = 400) -> None:
        pass

    def reject_room(self, room, message: str, status_code: int = 400) -> None:
        pass

    def load(self) -> dict[str, Any]:
        return {}

    def debug_state(self) -> dict[str, Any]:
        return {}

    def set_wake(self, wake) -> None:
        pass

    def attach_metrics(self, metrics) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class RoleHost:
    """What a KV connection (a PD role, a registered ``--kv-connector``, the host KV tier) may
    use of the engine; ``EngineCore`` builds it before its scheduler, and nothing in it is the
    scheduler or the engine itself.

    ``model_cfg``: the model's config (``vocab_size``, ``num_kv_heads``, ...). ``runner``: its
    KV methods (``kv_buffers``, ``gather_pages``, ``scatter_pages``, ``cache_specs``; ``LocalKV``
    and the host tier). ``kv``: the pages (``KVCacheManager``: its allocator's free count, the
    prefix cache's ``cached_pages_of``), read only. ``wait_for_device()``: block until the step
    in flight has run (pages a finish released are not written any more). ``wait_for_kv()``:
    block until every KV write dispatched so far has landed. ``abort_request(rid, message)``:
    end a request wherever the scheduler holds it (a role that failed it; unknown rids are
    ignored). ``num_prompt_tokens_computed()``: the scheduler's count (PD gauges).
    """

    args: ServerArgs
    model_path: str
    model_cfg: Any
    context_length: int
    runner: Any
    kv: Any
    wait_for_device: Callable[[], None]
    wait_for_kv: Callable[[], None]
    abort_request: Callable[[str, str], Any]
    num_prompt_tokens_computed: Callable[[], int]
