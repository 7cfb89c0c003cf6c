"""The OpenAI answers: whole responses, stream chunks, usage and logprobs (DESIGN.md §4).

Choice ``k`` of an ``OpenAIRequest`` is rendered from ``SampleResult`` ``k`` (whole answers)
or from its ``SampleDelta`` increments (streams).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from pdjax.detokenizer import TokenTexts
from pdjax.request import FinishReason
from pdjax.server.openai_api import OpenAIRequest
from pdjax.server.results import SampleDelta, SampleResult, json_logprob


def openai_finish_reason(finish_reason: FinishReason | None) -> str | None:
    """A ``FinishReason`` -> OpenAI's string (``stop``, ``length``, ``abort``)."""
    return None if finish_reason is None else finish_reason.type.value


def matched_stop(finish_reason: FinishReason | None) -> int | str | None:
    """SGLang's ``matched_stop``: the stop token or string a choice ended on, else None."""
    return finish_reason.matched if finish_reason is not None else None


def usage(req: OpenAIRequest, results: Sequence[SampleResult]) -> dict[str, Any]:
    """OpenAI ``usage``: prompt tokens once per prompt (its first sample), completion tokens
    over all samples, ``prompt_tokens_details.cached_tokens`` like the prompt tokens."""
    firsts = [r for r in results if r.index % req.n == 0]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def completion_logprobs(token_ids: Sequence[int], lps: Sequence[float],
                        tops: Sequence[Sequence[tuple[int, float]]], top_n: int,
                        texts: TokenTexts, text_offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [texts.text(t) for t in token_ids]
    offsets, off = [], text_offset
    for s in tokens:
        offsets.append(off)
        off += len(s)
    top_list = None
    if top_n > 0:
        top_list = []
        for top in tops:
            d: dict[str, float] = {}
            for t, lp in list(top)[:top_n]:
                d.setdefault(texts.text(t), json_logprob(lp))
            top_list.append(d)
    return {"tokens": tokens, "token_logprobs": [json_logprob(v) for v in lps],
            "top_logprobs": top_list, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], lps: Sequence[float],
                  tops: Sequence[Sequence[tuple[int, float]]], top_n: int,
                  texts: TokenTexts) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    content = []
    for pos, (t, lp) in enumerate(zip(token_ids, lps)):
        top = tops[pos] if pos < len(tops) and top_n > 0 else []
        content.append({
            "token": texts.text(t), "logprob": json_logprob(lp), "bytes": texts.token_bytes(t),
            "top_logprobs": [{"token": texts.text(tt), "logprob": json_logprob(tlp),
                              "bytes": texts.token_bytes(tt)} for tt, tlp in list(top)[:top_n]]})
    return {"content": content, "refusal": None}


def _choice_text(req: OpenAIRequest, r: SampleResult) -> str:
    if req.echo_texts is not None:
        return req.echo_texts[req.prompt_index(r.index)] + r.text
    return r.text


def _response(req: OpenAIRequest, results: Sequence[SampleResult], obj: str,
              logprobs: Callable[..., dict[str, Any]],
              choice: Callable[[SampleResult], tuple[dict[str, Any], str | None]]
              ) -> dict[str, Any]:
    """A non-streamed answer. Per result: ``choice(r)`` gives its content entry (``text`` or
    ``message``) and finish reason; ``logprobs(ids, lps, tops, top_n)`` its logprobs."""
    choices = []
    for r in results:
        content, finish = choice(r)
        lp = None
        if req.logprobs is not None:
            lp = logprobs(r.output_ids, r.output_logprobs, r.output_top_logprobs, req.logprobs)
        choices.append({"index": r.index, **content, "logprobs": lp, "finish_reason": finish,
                        "matched_stop": matched_stop(r.finish_reason)})
    return {"id": req.response_id, "object": obj, "created": req.created, "model": req.model,
            "choices": choices, "usage": usage(req, results), "system_fingerprint": None}


def completion_response(req: OpenAIRequest, results: Sequence[SampleResult],
                        texts: TokenTexts) -> dict[str, Any]:
    """The non-streamed ``text_completion`` object."""
    return _response(req, results, "text_completion",
                     lambda *lp: completion_logprobs(*lp, texts, 0),
                     lambda r: ({"text": _choice_text(req, r)},
                                openai_finish_reason(r.finish_reason)))


def chat_response(req: OpenAIRequest, results: Sequence[SampleResult],
                  texts: TokenTexts) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` object."""
    def choice(r: SampleResult) -> tuple[dict[str, Any], str | None]:
        finish = openai_finish_reason(r.finish_reason)
        out = req.chat_output.new_choice() if req.chat_output is not None else None
        if out is None:
            return {"message": {"role": "assistant", "content": r.text, "tool_calls": None}}, finish
        return {"message": out.message(r.text)}, out.finish_reason(finish)

    return _response(req, results, "chat.completion", lambda *lp: chat_logprobs(*lp, texts),
                     choice)


def _chunk(req: OpenAIRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    out = {"id": req.response_id, "object": obj, "created": req.created, "model": req.model,
           "choices": choices, "system_fingerprint": None}
    if req.include_usage:
        out["usage"] = None
    return out


def stream_start_chunks(req: OpenAIRequest) -> list[dict[str, Any]]:
    """Chunks sent before any token: the assistant role (chat) or the echoed prompt."""
    num = len(req.requests)
    if req.kind == "chat":
        return [_chunk(req, [{"index": k, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for k in range(num)]
    if req.echo_texts is not None:
        return [_chunk(req, [{"index": k, "text": req.echo_texts[req.prompt_index(k)],
                              "logprobs": None, "finish_reason": None}]) for k in range(num)]
    return []


def stream_delta_chunk(req: OpenAIRequest, d: SampleDelta, r: SampleResult,
                       texts: TokenTexts, text_offset: int) -> dict[str, Any] | None:
    """The chunk for one increment, or None when it carries nothing (no text, no tokens with
    logprobs, not finished). ``text_offset``: chars of this choice's text before ``d``."""
    want_lp = req.logprobs is not None and bool(d.token_ids)
    if not d.text and not want_lp and not d.finished:
        return None
    finish = openai_finish_reason(r.finish_reason) if d.finished else None
    if req.kind == "chat":
        lp = chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs, req.logprobs, texts) \
            if want_lp else None
        delta = {"content": d.text} if d.text else {}
        choice = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    else:
        lp = completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs, req.logprobs, texts,
                                 text_offset) if want_lp else None
        choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": finish}
    if d.finished:
        choice["matched_stop"] = matched_stop(r.finish_reason)
    return _chunk(req, [choice])


def stream_delta_chunks(req: OpenAIRequest, d: SampleDelta, r: SampleResult,
                        texts: TokenTexts, text_offset: int) -> list[dict[str, Any]]:
    """The chunks for one increment: ``stream_delta_chunk``'s, or, when the chat output is
    parsed (tools, reasoning), one chunk per parsed delta (a call's first delta alone); the
    increment's logprobs ride on the first, the finish reason on the last."""
    out = req.choice_output(d.index) if req.kind == "chat" else None
    if out is None:
        chunk = stream_delta_chunk(req, d, r, texts, text_offset)
        return [] if chunk is None else [chunk]
    deltas = out.stream(d.text, d.finished)
    want_lp = req.logprobs is not None and bool(d.token_ids)
    if not deltas and (want_lp or d.finished):
        deltas = [{}]
    chunks = []
    for j, delta in enumerate(deltas):
        lp = None
        if j == 0 and want_lp:
            lp = chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs, req.logprobs, texts)
        last = d.finished and j == len(deltas) - 1
        choice = {"index": d.index, "delta": delta, "logprobs": lp,
                  "finish_reason": out.finish_reason(openai_finish_reason(r.finish_reason))
                  if last else None}
        if last:
            choice["matched_stop"] = matched_stop(r.finish_reason)
        chunks.append(_chunk(req, [choice]))
    return chunks


def stream_usage_chunk(req: OpenAIRequest, results: Sequence[SampleResult]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    out = _chunk(req, [])
    out["usage"] = usage(req, results)
    return out
