"""The engine's side of speculative decoding (DESIGN.md §3, "Speculative decoding"): the
controller built from the settings, the sampling rows of a verify row, and reading a verify
row's emitted tokens. The scheduler adds the drafts (``pdjax.sched.spec_rows``); the device
verifies them (``pdjax.runner.verify``).
"""

from __future__ import annotations


import numpy as np

from pdjax.models.loader import checkpoint_config
from pdjax.runner.device_sampler import SamplingRow
import pdjax.spec.draft_model  # noqa: F401 (registers the "draft" drafter)
import pdjax.spec.mtp  # noqa: F401 (registers the "mtp" drafter)
from pdjax.spec.controller import SpecController
from pdjax.spec.drafter import create_drafter


def _speculates(args) -> bool:
    # A PD prefill server's requests end after their first token: it never decodes. A PD
    # decode server speculates from its first step: the prompt arrives with the first token,
    # and an n-gram drafter needs nothing else; the MTP drafter reads the prompt's hidden
    # states, which arrive with the KV pages (DESIGN.md §3, "Speculative decoding", PD).
    return args.speculative_algorithm is not None and args.role != "prefill"


def model_kwargs(args, model_path: str) -> dict:
    """Keyword arguments of the target's ``load_model`` that speculation needs: MTP builds the
    checkpoint's MTP layer and keeps every token's hidden state in the KV cache, on every role
    (a PD prefill server's hidden states travel to the decode server with the KV pages).
    ``ValueError`` naming ``speculative_algorithm`` when the checkpoint at ``model_path`` has
    no MTP layer (``num_nextn_predict_layers``)."""
    if args.speculative_algorithm != "mtp":
        return {}
    cfg = checkpoint_config(model_path)
    if getattr(cfg, "num_nextn_predict_layers", 0) < 1:
        raise ValueError(f"speculative_algorithm 'mtp' needs a DeepSeek-V3 / V3.2 / GLM-5 "
                         f"checkpoint with num_nextn_predict_layers >= 1; {model_path} has none")
    return {"mtp": True}


def make_speculator(args, config=None, target_cfg=None, runner=None) -> SpecController | None:
    """The ``SpecController`` of ``args.speculative_algorithm`` (None: off, or a PD prefill
    server). ``config`` (the resolved ``EngineConfig``) and ``target_cfg`` (the target's model
    config) size a draft model's pool and buckets and check its vocabulary; ``runner`` (the
    target's ``ModelRunner``) is what the MTP drafter runs beside."""
    if not _speculates(args):
        return None
    kwargs = {}
    if args.speculative_algorithm == "ngram":
        kwargs = {"min_match_window": args.speculative_ngram_min_match_window_size,
                  "max_match_window": args.speculative_ngram_max_match_window_size}
    elif args.speculative_algorithm == "draft":
        sched = config.scheduler
        kwargs = {"model_path": args.speculative_draft_model_path,
                  "target_vocab_size": target_cfg.vocab_size,
                  "num_pages": sched.num_pages, "page_size": sched.page_size,
                  "max_running_requests": sched.max_running_requests,
                  "context_length": min(sched.max_context_len,
                                        (sched.num_pages - 2) * sched.page_size),
                  "chunked_prefill_size": sched.chunked_prefill_size,
                  "max_num_batched_tokens": sched.max_num_batched_tokens,
                  "dtype": config.dtype, "kv_dtype": config.kv_dtype,
                  "attention_impl": config.attention_impl,
                  "pallas_interpret": args.pallas_interpret}
    elif args.speculative_algorithm == "mtp":
        sched = config.scheduler
        kwargs = {"target": runner, "num_pages": sched.num_pages,
                  "max_running_requests": sched.max_running_requests,
                  "context_length": min(sched.max_context_len,
                                        (sched.num_pages - 2) * sched.page_size),
                  "chunked_prefill_size": sched.chunked_prefill_size,
                  "max_num_batched_tokens": sched.max_num_batched_tokens}
    drafter = create_drafter(args.speculative_algorithm, **kwargs)
    return SpecController(drafter, args.speculative_num_draft_tokens,
                          adaptive=not args.speculative_disable_adaptive,
                          max_batch_size=args.speculative_disable_by_batch_size)


def verify_width(args) -> int:
    """Logits rows per request row of an extend bucket (``EntryPoints.verify_width``)."""
    return args.speculative_num_draft_tokens if _speculates(args) else 1


def verify_sampling_rows(req, draft_ids: list[int], penalty_slot: int,
                         eos_token_ids=()) -> list[SamplingRow]:
    """One ``SamplingRow`` per token of ``req``'s verify row: the draw of output position
    ``len(output_ids) + j`` with the request's parameters, ``draft_next`` the draft it is
    checked against (-1 for the last). Each row holds back the stop tokens (``eos_token_ids``
    and ``stop_token_ids``) below ``min_new_tokens`` at its own position, so a draft stop token
    there is rejected."""
    base = len(req.output_ids)
    rows = []
    for j in range(len(draft_ids) + 1):
        row = SamplingRow.from_request(req, penalty_slot, position=base + j,
                                       eos_token_ids=eos_token_ids)
        row.draft_next = draft_ids[j] if j < len(draft_ids) else -1
        rows.append(row)
    return rows


def fill_verify_masks(grammar, draft_ids: list[int], masks: np.ndarray) -> None:
    """Grammar masks ``masks [k+1, W]`` int32 of a verify row: row ``j`` allows what the
    grammar allows after the drafts before it. The matcher is advanced through the drafts it
    allows and rolled back, so it only ever takes emitted tokens (``stop_check``). From the
    first draft it does not allow (which row ``j`` then cannot sample: it is rejected there)
    or once it is terminated, the remaining rows stay all-ones (never emitted)."""
    consumed = 0
    for j in range(len(draft_ids) + 1):
        grammar.fill_bitmask(masks[j])
        if j == len(draft_ids) or grammar.is_terminated:
            break
        d = draft_ids[j]
        if not (int(masks[j].view(np.uint32)[d // 32]) >> (d % 32)) & 1 or not grammar.accept(d):
            break
        consumed += 1
    if consumed:
        grammar.rollback(consumed)


def emitted_tokens(tokens: np.ndarray, emitted: np.ndarray, span: tuple[int, int]) -> list[int]:
    """The tokens a verify row's logits rows ``span = (start, stop)`` emitted: the accepted
    drafts and the target's token after them (``emitted`` is a prefix of the span)."""
    start, stop = span
    out = []
    for l in range(start, stop):
        if not emitted[l]:
            break
        out.append(int(tokens[l]))
    return out


def must_read_first(speculator, scheduler, launched) -> bool:
    """Whether the step in flight ``launched`` must be read before the next is scheduled: it
    holds a verify row (how many tokens it emits is known only then), or a request that would
    speculate now (``SpecController.active``), whose draft continues its newest token.
    Requests backed off decode overlapped, as without speculation."""
    if speculator is None:
        return False
    return bool(launched.verify) or any(
        speculator.active(req.rid) for _, req, _ in launched.pending
        if scheduler.may_speculate(req))


def resolve_verify_row(core, verify, index: int, tokens: np.ndarray, emitted: np.ndarray,
                       lps: np.ndarray | None = None, tops=None):
    """Take a verify row's emitted tokens on ``core`` (an ``EngineCore``): the request keeps
    the accepted drafts and the target's own token, up to a stop, and the pages only rejected
    drafts reached go back (``Scheduler.resolve_verify``). ``verify = (ScheduledRow, logits
    span)``, ``index``: the request's placeholder; ``lps [L]`` / ``tops`` (``(ids, logprobs)``
    ``[L, K]``): the step's logprobs per logits row, when fetched. Returns the
    ``GenerateOutput`` increment, or None when the request ended while the step ran."""
    row, span = verify
    req = row.req
    toks = emitted_tokens(tokens, emitted, span)
    n, _ = core.scheduler.resolve_verify(row, index, toks, core.stop_check)
    if n == 0:
        return None
    core.speculator.on_verified(req.rid, len(row.draft_ids), len(toks) - 1, n)
    req.spec_verify_ct += 1
    req.spec_accepted_tokens += len(toks) - 1
    lp, top = [], []
    if req.return_logprob:
        k = req.top_logprobs_num
        for l in range(span[0], span[0] + n):
            lp.append(float(lps[l]))
            top.append([(int(a), float(b)) for a, b in zip(tops[0][l, :k], tops[1][l, :k])]
                       if k > 0 else [])
            req.append_logprobs(lp[-1], top[-1])
    return core.make_output(req, toks[:n], lp, top, num_output=index + n)
