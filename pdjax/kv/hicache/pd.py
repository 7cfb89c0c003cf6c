"""HiCache's tiers on a PD prefill server (``--role prefill --enable-hierarchical-cache``;
issue 43; DESIGN.md §3, "Host tier", and §4): the prefill role's connection and the host (and
storage) tier's, as one.

A prefill computes every prompt and sends its pages to the decode server; with the tiers a
prompt whose prefix is on the host (or in the store) loads it into the pages the scheduler
allocated, then computes the rest, and the role sends all its pages as it does after a device
prefix-cache hit (a tier hit is a prefix hit). The calls split as follows:

    get_num_new_matched_tokens   the role's first: None until its room is ready (nothing is
                                 loaded for a request that could not be sent); then the tier's
    update_state_after_alloc,    both (the tier plans its loads and writes; the role plans
    build_meta, update           the chunks it sends): ``build_meta`` is a ``(role, tier)``
                                 pair, the worker's ``start`` hands each its half
    request_finished             both; the role's answer holds the pages until they are sent
    owned_pages                  the role's (the tier owns no device page)
    worker.poll                  both, merged (``finished_sending`` from the role's worker,
                                 ``finished_recving`` from the tier's)

``PrefillWithHostTier`` is the engine's role too: it is the prefill role (every other
attribute is the role's) whose ``load`` adds the tier's ``/get_load`` fields and whose
``attach_metrics`` / ``set_wake`` / ``close`` reach both. Pure Python.
"""

from __future__ import annotations

from typing import Any, Callable

from pdjax.sched.kv_connector import KVConnectorOutput


class _PairedWorker:
    """The role's transfer worker and the tier's, started and polled together."""

    def __init__(self, pd_worker, tier_worker):
        self.pd, self.tier = pd_worker, tier_worker

    def start(self, meta) -> None:
        pd_meta, tier_meta = meta
        if pd_meta is not None:
            self.pd.start(pd_meta)
        if tier_meta is not None:
            self.tier.start(tier_meta)

    def poll(self) -> KVConnectorOutput:
        a, b = self.pd.poll(), self.tier.poll()
        return KVConnectorOutput(
            finished_sending=a.finished_sending | b.finished_sending,
            finished_recving=a.finished_recving | b.finished_recving,
            first_tokens={**a.first_tokens, **b.first_tokens},
            failed_recving={**a.failed_recving, **b.failed_recving})

    def has_work(self) -> bool:
        return self.pd.has_work() or self.tier.has_work()

    def close(self) -> None:
        self.tier.close()
        self.pd.close()

    # the tier's, for tests and admission
    def flush(self) -> None:
        self.tier.flush()

    @property
    def storage(self):
        return self.tier.storage

    @property
    def pool(self):
        return self.tier.pool

    @property
    def num_in_flight(self) -> int:
        return self.tier.num_in_flight


class PrefillWithHostTier:
    """The prefill role ``pd`` (``transfer.prefill.PrefillConnector``) with the tier of
    ``tier`` (``connector``, ``worker``, ``role`` from ``worker.build_host_tier``), as the
    scheduler's connector and the engine's role (see the module docstring)."""

    def __init__(self, pd, tier_connector, tier_worker, tier_role):
        self._pd = pd
        self.tier = tier_connector
        self.tier_role = tier_role
        self.worker_pair = _PairedWorker(pd.worker, tier_worker)

    def __getattr__(self, name: str) -> Any:          # every other call is the role's
        return getattr(self._pd, name)

    # ---- the scheduler's connector --------------------------------------------------------
    @property
    def index(self):
        return self.tier.index

    @property
    def stats(self):
        return self.tier.stats

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int | None:
        if self._pd.get_num_new_matched_tokens(req, num_computed_tokens) is None:
            return None
        return self.tier.get_num_new_matched_tokens(req, num_computed_tokens)

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        self._pd.update_state_after_alloc(req, num_external_tokens)
        self.tier.update_state_after_alloc(req, num_external_tokens)

    def build_meta(self, batch):
        pd_meta, tier_meta = self._pd.build_meta(batch), self.tier.build_meta(batch)
        return None if pd_meta is None and tier_meta is None else (pd_meta, tier_meta)

    def request_finished(self, req) -> bool:
        self.tier.request_finished(req)
        return self._pd.request_finished(req)

    def update(self, output: KVConnectorOutput) -> None:
        self._pd.update(output)
        self.tier.update(output)

    def owned_pages(self) -> list[int]:
        return self._pd.owned_pages()

    # ---- the engine's role ----------------------------------------------------------------
    def has_work(self) -> bool:
        return self._pd.has_work() or self.worker_pair.has_work()

    def load(self) -> dict[str, Any]:
        return {**self._pd.load(), **self.tier_role.load()}

    def set_wake(self, wake: Callable[[], None]) -> None:
        self._pd.set_wake(wake)
        self.tier_role.set_wake(wake)

    def attach_metrics(self, metrics: Any) -> None:
        self._pd.attach_metrics(metrics)
        self.tier_role.attach_metrics(metrics)

    def close(self) -> None:
        self.worker_pair.tier.close()
        self._pd.close()


def with_host_tier(host, pd):
    """``(connector, worker, role)`` of prefill role ``pd`` with the host tier (and the
    storage tier of ``--hicache-storage-backend``) of engine ``host``."""
    from pdjax.kv.hicache.worker import build_host_tier

    both = PrefillWithHostTier(pd, *build_host_tier(host))
    return both, both.worker_pair, both
