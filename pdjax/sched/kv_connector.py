"""The scheduler's side of KV transfer: the ``KVConnector`` it calls (DESIGN.md §4).

Shaped after vLLM V1's KV-connector API (``KVConnectorBase_V1``, scheduler role:
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``, ``update_connector_output``). The scheduler calls a connector at five
points and keeps every page it reserves or holds for one in its own books, so that
``Scheduler.check_invariants`` still sees the whole pool:

    admission of a waiting request:
        n = connector.get_num_new_matched_tokens(req, num_local_tokens)
        (admitted when the whole prompt's pages could be freed, as any request; the n
        tokens' pages are allocated now, the rest as the prompt runs)
        connector.update_state_after_alloc(req, n)
        n > 0: req waits in ``Scheduler.waiting_remote`` until the worker has
        written the n tokens' KV (``finished_recving``), then runs from token local + n
    after a step:   meta = connector.build_meta(batch)     -> KVTransferWorker.start(meta)
    a finish:       connector.request_finished(req) -> True: the pages stay (``held``) until
                    ``finished_sending`` names the request
    every step:     Scheduler.update_from_kv_output(worker.poll()) -> connector.update(out)

A connector that admits requests by its own rules (the PD decode role: its requests wait for
a pairing and a page list, and arrive with their first token) reserves through the
scheduler's public ``reserve_remote`` / ``commit_remote`` / ``drop_remote`` instead; pages it
keeps outside any request (a decode's quarantine) it reports through ``owned_pages``.

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


@dataclasses.dataclass
class KVConnectorOutput:
    """What the transfer worker finished since its last ``poll()`` (vLLM's
    ``KVConnectorOutput``): ``finished_sending`` -- rids of held requests whose KV has left
    (their pages may go back); ``finished_recving`` -- rids in ``waiting_remote`` whose KV has
    arrived (they may run)."""

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving)


@runtime_checkable
class KVConnector(Protocol):
    """The calls ``Scheduler`` makes to a KV connector (see the module docstring). All run on
    the engine thread."""

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int:
        """Tokens of ``req``'s prompt past its ``num_computed_tokens`` local prefix hit whose
        KV the connector will provide (0: none). They always arrive asynchronously (vLLM's
        ``load_kv_async``): the request waits in ``waiting_remote`` for ``finished_recving``.
        The count must be whole pages and leave at least one prompt token to compute (its
        logits give the first output token); it is asked again if the pages cannot be freed
        now. Not asked for a request that wants prompt logprobs or was retracted."""

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        """``req`` was admitted and ``req.pages`` covers its prompt; the connector may now
        plan to write the ``num_external_tokens`` tokens after its local prefix."""

    def build_meta(self, batch: ScheduledBatch | None) -> Any:
        """After a step's results were read (``batch`` None: no forward was read): what the
        worker must move now, handed to ``KVTransferWorker.start``; None for nothing."""

    def request_finished(self, req: Request) -> bool:
        """``req`` finished; True keeps its pages (``Scheduler.held``) until the worker names it
        in ``finished_sending``, False lets the scheduler release them now."""

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
