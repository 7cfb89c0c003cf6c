"""The scheduler's side of KV transfer: the ``KVConnector`` it calls (DESIGN.md §4).

Shaped after vLLM V1's KV-connector API (``KVConnectorBase_V1``, scheduler role:
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``, ``update_connector_output``). The scheduler calls a connector at five
points and keeps every page it reserves or holds for one in its own books
(``pdjax.sched.remote_kv.RemoteKV``), so that ``Scheduler.check_invariants`` still sees the
whole pool. There is one admission path, for every request of every role:

    admission of a waiting request (arrival order):
        n = connector.get_num_new_matched_tokens(req, num_local_tokens)
        None: not yet (e.g. a PD decode still pairing with its prefill): the request stays
              in the queue, skipped, and is asked again at the next step
        0:    nothing from elsewhere: the prompt is computed here
        n:    admitted when its pages (and, when n covers the rest of the prompt, the pages
              reserved for decode tokens) could be freed; the pages are allocated now and
              connector.update_state_after_alloc(req, n) gets them; req waits in
              ``waiting_remote`` until the worker names it in ``finished_recving``
    after a step:   meta = connector.build_meta(batch)     -> KVTransferWorker.start(meta)
    a finish:       connector.request_finished(req) -> True: the pages stay (``held``) until
                    ``finished_sending`` names the request (also for a request that fails
                    or is aborted while its KV arrives: a late write may still land)
    every step:     Scheduler.update_from_kv_output(worker.poll()) -> connector.update(out)

When ``n`` covers the whole rest of the prompt (the PD decode), the prompt is never computed
here: ``finished_recving`` must come with the first output token (``first_tokens``; the
prefill sampled it) and the request decodes from its second token. ``failed_recving`` ends a
request the connector gave up on (its pages go back, or stay held, by ``request_finished``).

``NullConnector`` is the colocated server's: nothing is remote, nothing is held. A connector
is built, with its worker, by ``pdjax.transfer.factory`` (``register_kv_connector`` names one
``--kv-connector`` can pick). Pure Python; imports nothing of ``pdjax`` but the request types.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:      # annotations only
    from pdjax.request import Request
    from pdjax.sched.scheduled_batch import ScheduledBatch


@dataclasses.dataclass(frozen=True)
class FirstToken:
    """The first output token of a request whose whole prompt's KV came from elsewhere (the
    PD prefill sampled it): ``token_id``; its ``logprob`` and ``top_logprobs`` (``(id,
    logprob)`` pairs) when the request asked for them; ``cached_tokens``: the prompt tokens
    the request reused on either side (reported as ``cached_tokens``; None: its local hit)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class RecvFailure:
    """Why the connector gave up on a request's KV: ``message`` for the client, HTTP
    ``status_code`` (None: 500)."""

    message: str
    status_code: int | None = None


@dataclasses.dataclass
class KVConnectorOutput:
    """What the transfer worker finished since its last ``poll()`` (vLLM's
    ``KVConnectorOutput``): ``finished_sending`` -- rids of held requests whose KV has left
    (their pages may go back); ``finished_recving`` -- rids in ``waiting_remote`` whose KV has
    arrived (they may run); ``first_tokens`` -- for those whose whole prompt arrived, the first
    output token; ``failed_recving`` -- rids (waiting or in ``waiting_remote``) whose KV will
    not come, and why."""

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    first_tokens: dict[str, FirstToken] = dataclasses.field(default_factory=dict)
    failed_recving: dict[str, RecvFailure] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


@runtime_checkable
class KVConnector(Protocol):
    """The calls ``Scheduler`` makes to a KV connector (see the module docstring). All run on
    the engine thread."""

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int | None:
        """Tokens of ``req``'s prompt past its ``num_computed_tokens`` local prefix hit whose
        KV the connector will provide (0: none; None: not known yet, ask again next step).
        They always arrive asynchronously (vLLM's ``load_kv_async``): the request waits in
        ``waiting_remote`` for ``finished_recving``. The count must be whole pages leaving at
        least one prompt token to compute, or exactly the rest of the prompt (then the first
        output token arrives in ``KVConnectorOutput.first_tokens``). Asked again when the
        pages cannot be freed now; not asked for a retracted request. For a request that
        wants prompt logprobs only the rest of the prompt counts (its prompt's logprobs come
        from where the prompt is computed: the PD prefill); a part of it is ignored."""

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        """``req`` was admitted and ``req.pages`` covers its prompt (``num_external_tokens``
        > 0: up to the external tokens); the connector may now plan to write the
        ``num_external_tokens`` tokens after its local prefix. After a "rest of the prompt"
        answer the count may be smaller than answered, 0 included: every full page of the
        prompt the prefix cache holds is used (the first token still comes)."""

    def build_meta(self, batch: ScheduledBatch | None) -> Any:
        """After a step's results were read (``batch`` None: no forward was read): what the
        worker must move now, handed to ``KVTransferWorker.start``; None for nothing."""

    def request_finished(self, req: Request) -> bool:
        """``req`` finished, failed or was aborted (running, or admitted and waiting for its
        KV); True keeps its pages (``Scheduler.held``) until the worker names it in
        ``finished_sending``, False lets the scheduler release them now. Also called for an
        aborted or failed request still in the queue (no pages: the answer is ignored)."""

    def update(self, output: KVConnectorOutput) -> None:
        """What the worker finished (after the scheduler applied it to its page books)."""

    def owned_pages(self) -> list[int]:
        """Pages the connector keeps outside any request (counted by ``check_invariants``)."""


class NullConnector:
    """Colocated serving: no KV comes from elsewhere, no finished request is held."""

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        return 0

    def update_state_after_alloc(self, req, num_external_tokens):
        pass

    def build_meta(self, batch):
        return None

    def request_finished(self, req):
        return False

    def update(self, output):
        pass

    def owned_pages(self):
        return []
