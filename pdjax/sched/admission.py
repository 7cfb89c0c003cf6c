"""The one admission path (DESIGN.md §3, §4): which pages a queued request gets and where its
prompt's KV comes from, and how a request whose KV arrived from elsewhere starts.

``Scheduler`` decides when a request is tried (queue order, running slots, the prefill step);
``admit`` decides what it gets, for every request of every role::

    queued request --KVCacheManager.match_prefix--> h local tokens (whole pages; never the
        prompt's last token, nor a position whose prompt logprob is asked for)
      --KVConnector.get_num_new_matched_tokens(req, h)--> None: NOT_YET (asked again next step)
                                                          0:    computed here
                                                          n:    n tokens arrive from elsewhere
      --KVCacheManager.make_free(pages of the prompt + 1, or of the prompt plus the decode
        reservation when n is the whole rest of it)--> RUNNING / REMOTE (RemoteKV.admit), or
        NO_ROOM (nothing changed)

A retracted request recomputes what it had: the connector is not asked again. Pure Python;
never imports JAX.
"""

from __future__ import annotations

import enum

from pdjax.request import Request
from pdjax.sched.kv_cache_manager import KVCacheManager
from pdjax.sched.kv_connector import FirstToken
from pdjax.sched.remote_kv import RemoteKV


class AdmitResult(enum.Enum):
    """What ``admit`` did with a queued request."""

    RUNNING = "running"    # pages reserved; it is computed here from past its prefix hit
    REMOTE = "remote"      # pages reserved; its KV arrives from elsewhere (``RemoteKV``)
    NOT_YET = "not_yet"    # the connector does not know yet: it stays queued, skipped
    NO_ROOM = "no_room"    # nothing changed: its pages cannot be freed (or ``remote_only``
    #                        and nothing of it comes from elsewhere)


def admit(req: Request, kv: KVCacheManager, remote: RemoteKV, running: list[Request],
          remote_only: bool = False) -> AdmitResult:
    """Admit the queued ``req``: its prefix-cache hit, then what ``remote.connector`` has of
    the rest (``KVConnector.get_num_new_matched_tokens``; such a request goes to
    ``remote.waiting``), if the pages of its prompt plus one (plus, for a whole prompt from
    elsewhere, ``RemoteKV.reserved_decode_pages`` for it and ``running``) can be freed.

    On RUNNING, ``req`` holds its pages and has started (the caller appends it to its running
    batch); on REMOTE it is in ``remote.waiting``. ``remote_only``: admit only a request whose
    KV comes from elsewhere (NO_ROOM otherwise). ``ValueError`` (``RemoteKV.check_external``)
    for a connector's count that is neither the rest of the prompt nor whole pages."""
    ps = kv.page_size
    max_pages = (req.num_tokens - 1) // ps
    prompt_logprobs = req.return_logprob and req.logprob_start_len >= 0
    if prompt_logprobs:
        max_pages = min(max_pages, max(0, req.logprob_start_len - 1) // ps)
    pages, node = kv.match_prefix(req, max_pages)
    external, whole = 0, False
    if not req.output_ids:            # a retracted request recomputes what it had
        external = remote.connector.get_num_new_matched_tokens(req, len(pages) * ps)
        if external is None:
            remote.not_yet.add(req.rid)
            return AdmitResult.NOT_YET
        whole = bool(external) and RemoteKV.check_external(req, len(pages) * ps, external, ps)
        if prompt_logprobs and not whole:
            external = 0              # its prompt's logprobs need the prompt computed here
        if whole and len(pages) < req.num_prompt_tokens // ps:
            # Nothing is computed here: the prompt's last full page may be a hit too (the
            # rest of the prompt then has no token; the first token still comes).
            pages, node = kv.match_prefix(req, req.num_prompt_tokens // ps)
            external = req.num_prompt_tokens - len(pages) * ps
    remote.not_yet.discard(req.rid)
    if remote_only and not whole and not external:
        return AdmitResult.NO_ROOM
    need = -(-req.num_tokens // ps) + 1 - len(pages)
    reserve = 0
    if whole:
        need -= 1                     # nothing is computed here: no page for a next token
        reserve = remote.reserved_decode_pages(req, running)
    kv.prefix_cache.lock(node)
    # The decode reservation yields when nothing else holds pages (it could never fit).
    if not kv.make_free(need + reserve, req) and (
            not reserve or kv.same_pool(req, [*running, *remote.waiting.values()])
            or not kv.make_free(need, req)):
        kv.prefix_cache.unlock(node)
        return AdmitResult.NO_ROOM
    req.prefix_node = node
    req.pages = list(pages)
    if external or whole:
        remote.admit(req, external)
        return AdmitResult.REMOTE
    req.start_running(len(pages) * ps)
    remote.connector.update_state_after_alloc(req, 0)
    return AdmitResult.RUNNING


def start_after_prefix(req: Request, kv: KVCacheManager) -> None:
    """``req``'s KV arrived for whole pages of its prompt (``req.pages``): it starts from past
    them (reported as cached; their full pages shared in the prefix cache) and computes the
    rest of its prompt here. The caller appends it to its running batch."""
    loaded = len(req.pages) * kv.page_size
    req.start_running(req.num_cached_tokens)
    req.set_num_computed_tokens(loaded)
    req.set_reported_cached_tokens(loaded)
    kv.share(req, loaded)


def start_with_first_token(req: Request, first: FirstToken, step_id: int) -> None:
    """``req``'s whole prompt's KV is in its pages and its first output token is ``first``
    (with its logprobs when asked for): it decodes from that token, whose KV the next decode
    step computes (the prompt is never recomputed). The caller appends it to its running
    batch and checks the stop conditions."""
    req.start_prebuilt(first.token_id, step_id)
    if req.return_logprob:
        req.append_logprobs(float(first.logprob or 0.0),
                            list(first.top_logprobs)[:req.top_logprobs_num])
    if first.cached_tokens is not None:
        req.set_reported_cached_tokens(first.cached_tokens)
