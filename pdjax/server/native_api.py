"""SGLang's ``/generate``: the request parsed into one ``GenerateRequest`` per sample, and the
answer for one sample (DESIGN.md §4).

``text`` or ``input_ids``, single or batch, with ``n`` from ``sampling_params``. Samples are
ordered as SGLang orders them, ``k = j * batch + i`` (sample ``j`` of prompt ``i``), and the
response list follows that order. PD fields: see ``validation.pd_fields``. Every bad input
raises ``RequestError`` naming the field; fields that ask for behaviour pdjax does not have are
rejected, never ignored; a field set to ``null`` counts as absent.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Callable, Sequence

from pdjax.detokenizer import TokenTexts
from pdjax.engine_io import GenerateRequest
from pdjax.request import INT32_MAX, FinishReason, SamplingParams
from pdjax.server.errors import RequestError
from pdjax.server.results import SampleResult, json_logprob
from pdjax.server.validation import (MAX_TOP_LOGPROBS, ServingContext, check_batch_size,
                                     check_bool, check_int, check_max_new_tokens,
                                     check_num_samples,
                                     check_prompt_length, check_str, check_token_ids,
                                     check_grammar, checked_body, clamp_default_max_new, encode_prompt,
                                     parse_sampling_params, pd_fields, sample_params)


@dataclasses.dataclass
class NativeRequest:
    """A parsed ``/generate`` body. ``requests[k]`` is sample ``k``; ``is_single``: answer with
    one object (else a list). ``group_rid``: the caller's ``rid`` (for ``/abort_request``)."""

    requests: list[GenerateRequest]
    is_single: bool
    stream: bool
    return_text_in_logprobs: bool = False
    group_rid: str | None = None
    log_metrics: bool = True
    reasoning_parser: str | None = None     # set by ``separate_reasoning: true``


_NATIVE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob",
                  "top_logprobs_num", "logprob_start_len", "rid", "bootstrap_host",
                  "bootstrap_port", "bootstrap_room", "return_text_in_logprobs", "log_metrics",
                  "separate_reasoning"}
_NATIVE_DEFAULT_ONLY: dict[str, Callable[[Any], bool]] = {
    "image_data": lambda v: v in ([], ""), "video_data": lambda v: v in ([], ""),
    "audio_data": lambda v: v in ([], ""), "input_embeds": lambda v: False,
    "lora_path": lambda v: False, "session_params": lambda v: False,
    "custom_logit_processor": lambda v: False, "token_ids_logprob": lambda v: v == [],
    "return_hidden_states": lambda v: v is False, "routed_dp_rank": lambda v: v == 0,
    "data_parallel_rank": lambda v: v == 0, "disagg_prefill_dp_rank": lambda v: v == 0,
    # Sent with their defaults by sglang-router (PD mode).
    "background": lambda v: v is False, "no_logs": lambda v: isinstance(v, bool),
    "return_bytes": lambda v: v is False, "return_entropy": lambda v: v is False,
}


def _per_prompt(name: str, value: Any, batch: int, n: int, default: Any,
                check: Callable[[str, Any], Any]) -> list[Any]:
    """A native per-prompt field: scalar, or (batch requests with n == 1) a list of ``batch``."""
    if value is None:
        return [default] * batch
    if isinstance(value, list):
        if n > 1:
            raise RequestError(f"{name} cannot be a list when n > 1", name)
        if len(value) != batch:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {batch}", name)
        return [check(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [check(name, value)] * batch


def parse_generate_request(body: Any, ctx: ServingContext) -> NativeRequest:
    """Validate a ``/generate`` body (SGLang's ``GenerateReqInput`` fields) and expand it into
    one ``GenerateRequest`` per sample (prompt-major within each sample index). Raises
    ``RequestError``."""
    body = checked_body(body, _NATIVE_FIELDS, _NATIVE_DEFAULT_ONLY, "/generate")
    if ("text" in body) == ("input_ids" in body):
        raise RequestError("exactly one of text or input_ids must be given", "text")
    is_single, prompts = _prompts(body, ctx)
    batch = len(prompts)
    sp_list = _sampling_params(body, ctx, prompts, is_single)
    n = sp_list[0].n
    if n > 1:
        is_single = False
    check_num_samples(batch, n, "sampling_params.n")
    num = batch * n

    stream = check_bool("stream", body.get("stream", False))
    ret_lp = _per_prompt("return_logprob", body.get("return_logprob"), batch, n, False, check_bool)
    top_n = _per_prompt("top_logprobs_num", body.get("top_logprobs_num"), batch, n, 0,
                        lambda nm, v: check_int(nm, v, 0, MAX_TOP_LOGPROBS))
    start = _per_prompt("logprob_start_len", body.get("logprob_start_len"), batch, n, -1,
                        lambda nm, v: check_int(nm, v, -1, INT32_MAX))
    for i in range(batch):
        if start[i] >= len(prompts[i]):
            raise RequestError(f"logprob_start_len = {start[i]} must be below the prompt length "
                               f"({len(prompts[i])})", "logprob_start_len")
    rids, group_rid = _request_ids(body.get("rid"), batch, n, is_single)

    reasoning_parser = None
    if check_bool("separate_reasoning", body.get("separate_reasoning", False)):
        if ctx.reasoning_parser is None:
            raise RequestError("separate_reasoning needs a reasoning parser: start the server "
                               "with --reasoning-parser", "separate_reasoning")
        reasoning_parser = ctx.reasoning_parser

    hosts, ports, rooms = pd_fields(body, num)
    reqs = []
    for k in range(num):
        i = k % batch
        reqs.append(GenerateRequest(
            rid=rids[k], input_ids=list(prompts[i]),
            sampling_params=sample_params(sp_list[i], k // batch),
            return_logprob=ret_lp[i], top_logprobs_num=top_n[i] if ret_lp[i] else 0,
            logprob_start_len=start[i] if ret_lp[i] else -1,
            bootstrap_host=hosts[k], bootstrap_port=ports[k], bootstrap_room=rooms[k]))
    return NativeRequest(
        requests=reqs, is_single=is_single, stream=stream,
        return_text_in_logprobs=check_bool("return_text_in_logprobs",
                                           body.get("return_text_in_logprobs", False)),
        group_rid=group_rid,
        log_metrics=check_bool("log_metrics", body.get("log_metrics", True)),
        reasoning_parser=reasoning_parser)


def _prompts(body: dict, ctx: ServingContext) -> tuple[bool, list[list[int]]]:
    """``(is_single, token ids of each prompt)`` from ``text`` or ``input_ids``: a string or a
    flat id list is one prompt, a list of them a batch; each checked against the context."""
    prompts: list[list[int]]
    if "text" in body:
        text = body["text"]
        if isinstance(text, str):
            is_single, texts = True, [text]
        elif isinstance(text, list) and text:
            is_single, texts = False, text
            check_batch_size("text", len(texts))
        else:
            raise RequestError("text must be a string or a non-empty list of strings", "text")
        prompts = []
        for i, t in enumerate(texts):
            name = "text" if is_single else f"text[{i}]"
            check_str(name, t)
            if not t:
                raise RequestError(f"{name} is empty: the prompt needs at least one token", "text")
            prompts.append(encode_prompt(ctx, t, param=name))
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or of lists)",
                               "input_ids")
        if all(isinstance(x, list) for x in ids):
            is_single = False
            check_batch_size("input_ids", len(ids))
            prompts = [check_token_ids(f"input_ids[{i}]", x, ctx) for i, x in enumerate(ids)]
        else:
            is_single = True
            prompts = [check_token_ids("input_ids", ids, ctx)]
    field = "text" if "text" in body else "input_ids"
    for i, p in enumerate(prompts):
        check_prompt_length(field if is_single else f"{field}[{i}]", p, ctx)
    return is_single, prompts


def _sampling_params(body: dict, ctx: ServingContext, prompts: list[list[int]],
                     is_single: bool) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt from ``sampling_params`` (one object, or one per
    prompt of a batch); an unset ``max_new_tokens`` is clamped to the context, grammars are
    compiled (a bad one is a 400 now), and ``n`` must agree across prompts. A
    ``max_new_tokens`` the client set must fit in the context after its prompt."""
    batch = len(prompts)
    sp_raw = body.get("sampling_params", {})
    if isinstance(sp_raw, dict):
        sp_list = [parse_sampling_params(sp_raw, ctx, "sampling_params")] * batch
        explicit = ["max_new_tokens" in sp_raw] * batch
    elif isinstance(sp_raw, list) and not is_single:
        if len(sp_raw) != batch or not all(isinstance(d, dict) for d in sp_raw):
            raise RequestError(f"sampling_params must be an object or a list of {batch} objects",
                               "sampling_params")
        sp_list = [parse_sampling_params(d, ctx, f"sampling_params[{i}]")
                   for i, d in enumerate(sp_raw)]
        explicit = ["max_new_tokens" in d for d in sp_raw]
    else:
        raise RequestError("sampling_params must be an object (or a list of objects for a batch)",
                           "sampling_params")
    for sp, exp, p in zip(sp_list, explicit, prompts):
        if exp:         # asked for: refused when the prompt leaves no room for it (vLLM's 400)
            check_max_new_tokens("max_new_tokens", sp, len(p), ctx)
    sp_list = [sp if exp else clamp_default_max_new(sp, len(p), ctx)
               for sp, exp, p in zip(sp_list, explicit, prompts)]
    for sp in sp_list:
        check_grammar(sp.grammar, ctx)
    if any(sp.n != sp_list[0].n for sp in sp_list):
        raise RequestError("sampling_params: n must be the same for every prompt",
                           "sampling_params")
    return sp_list


def _request_ids(rid: Any, batch: int, n: int, is_single: bool) -> tuple[list[str], str | None]:
    """``(one rid per sample, the group's rid or None)``: generated when ``rid`` is absent; a
    string names the group (``rid_k`` per sample unless there is one); a list gives one per
    prompt of a batch. Raises ``RequestError`` for a bad or repeated id."""
    num = batch * n
    group_rid = None
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        check_str("rid", rid, allow_empty=False)
        group_rid = rid
        rids = [rid] if num == 1 and is_single else [f"{rid}_{k}" for k in range(num)]
    elif isinstance(rid, list) and not is_single:
        if len(rid) != batch:
            raise RequestError(f"rid has {len(rid)} entries for a batch of {batch}", "rid")
        for i, r in enumerate(rid):
            check_str(f"rid[{i}]", r, allow_empty=False)
        rids = [rid[k % batch] if n == 1 else f"{rid[k % batch]}_{k // batch}" for k in range(num)]
    else:
        raise RequestError("rid must be a string (or a list of strings for a batch)", "rid")
    if len(set(rids)) != len(rids):
        raise RequestError("rid: request ids in one request must be distinct", "rid")
    return rids, group_rid


# ---------------------------------------------------------------------------------------------
# The answer
# ---------------------------------------------------------------------------------------------

def native_finish_reason(finish_reason: FinishReason | None) -> dict[str, Any] | None:
    """SGLang's ``meta_info.finish_reason`` dict, or None while the request runs."""
    return finish_reason.to_dict() if finish_reason is not None else None


def _native_lp_entries(lps: Sequence[float | None], ids: Sequence[int], texts: TokenTexts | None):
    return [[json_logprob(lp), int(t), texts.text(t) if texts else None] for lp, t in zip(lps, ids)]


def _native_top_entries(tops, texts: TokenTexts | None):
    out = []
    for top in tops:
        if top is None:
            out.append(None)
        else:
            out.append([[json_logprob(lp), int(t), texts.text(t) if texts else None]
                        for t, lp in top])
    return out


def native_response(r: SampleResult, req: GenerateRequest, token_texts: TokenTexts | None,
                    index: int | None = None) -> dict[str, Any]:
    """SGLang's ``/generate`` answer for one sample (cumulative; also each stream event).

    ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
    "completion_tokens", "cached_tokens", "e2e_latency", [spec_verify_ct, spec_accept_len],
    [logprob fields]}, ["index"]}``.
    Logprob entries are ``[logprob, token_id, token_text_or_null]``; ``token_texts`` given
    means ``return_text_in_logprobs``.
    """
    meta: dict[str, Any] = {
        "id": r.rid, "finish_reason": native_finish_reason(r.finish_reason),
        "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens, "e2e_latency": round(r.e2e_latency, 6),
        **r.spec_meta_info()}
    if req.return_logprob:
        start = req.logprob_start_len if req.logprob_start_len >= 0 else len(r.prompt_ids)
        prompt_ids = r.prompt_ids[start:]
        plp = r.prompt_logprobs or []
        meta["input_token_logprobs"] = _native_lp_entries(plp, prompt_ids, token_texts)
        meta["output_token_logprobs"] = _native_lp_entries(r.output_logprobs, r.output_ids,
                                                           token_texts)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _native_top_entries(r.prompt_top_logprobs or [],
                                                             token_texts)
            meta["output_top_logprobs"] = _native_top_entries(r.output_top_logprobs, token_texts)
    out = {"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out
