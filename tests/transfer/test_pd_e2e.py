"""PD disaggregation end to end: a prefill server, a decode server and the router, three real
processes on 127.0.0.1 with the Mooncake backend, checked against the colocated
engine; then sglang-router (PyPI) in front of the same two servers."""

import collections
import concurrent.futures
import json
import random
import sys
import time

import pytest
from pd_harness import (CHUNK, EOS, PAGE_SIZE, TINY_ARGS, Server, at_baseline, child_env,
                        count_runs, free_port, get, greedy_agrees, load, metric_value,
                        pd_router, pd_server, pd_state, post, post_stream, running,
                        wait_until)

pytestmark = pytest.mark.slow


# One added token of the servers' tokenizer (the model has 512 rows, the tokenizer 448) holds a
# whole Hermes call, so a logit bias makes the random model write one (tool_choice "auto").
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 35}}\n</tool_call>\n'


def _tool_tokenizer(model: str, out_dir: str):
    """The model's tokenizer plus ``CALL_TEXT`` as one token, with a chat template that also
    names the tools (the same prompt as before without tools); saved to ``out_dir``. Returns
    ``(out_dir, the call token's id)``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens([CALL_TEXT])
    tok.chat_template = ("{% if tools %}{% for t in tools %}{{ t.function.name }} {% endfor %}"
                         "{% endif %}" + tok.chat_template)
    tok.save_pretrained(out_dir)
    return out_dir, tok.convert_tokens_to_ids(CALL_TEXT)


@pytest.fixture(scope="module")
def pd(tiny_checkpoints, tmp_path_factory):
    """Prefill P1, decode D1 and the pdjax router, plus the colocated reference engine. The
    servers parse Hermes tool calls and use ``_tool_tokenizer``'s tokenizer."""
    logs = str(tmp_path_factory.mktemp("pd_e2e"))
    model = tiny_checkpoints["llama"]
    tok_dir, call_id = _tool_tokenizer(model, str(tmp_path_factory.mktemp("pd_e2e_tokenizer")))
    extra = ["--tokenizer-path", tok_dir, "--tool-call-parser", "hermes"]
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, extra=extra)
    decode = pd_server("decode", "decode", model, logs, extra=extra)
    router = pd_router("router", prefill, bport, decode, logs)
    from pdjax.engine import Engine

    colocated = Engine(model_path=model, progress=False, **TINY_ARGS)
    try:
        with running([prefill, decode, router]):
            yield dict(prefill=prefill, decode=decode, router=router, colocated=colocated,
                       model=model, bport=bport, logs=logs, call_id=call_id)
    finally:
        colocated.shutdown()


def _reference(engine, prompts, max_new):
    outs = engine.generate(input_ids=prompts, return_logprob=True, top_logprobs_num=2,
                           sampling_params=[{"temperature": 0, "max_new_tokens": m} for m in max_new])
    return [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in outs]


def _generate(url, ids, max_new, stream=False, **extra):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new},
            **extra}
    if stream:
        status, events = post_stream(url + "/generate", body)
        assert status == 200, events
        assert all(not e.get("error") for e in events), events
        return events[-1]
    status, out = post(url + "/generate", body)
    assert status == 200, out
    return out


def _records_by_len(state):
    by_len = collections.defaultdict(list)
    for rec in state["recent"]:
        by_len[rec["prompt_len"]].append(rec)
    return by_len


def _reserved(decode, prompt_lens: set[int]) -> bool:
    """Whether the decode has reserved pages for a room of each prompt length (live or
    finished)."""
    state = pd_state(decode)
    done = {r["prompt_len"] for r in state["rooms"] + state["recent"]
            if r["dst_pages"] or r["state"] != "Bootstrapping"}
    return prompt_lens <= done


def test_32_concurrent_greedy_requests_match_colocated(pd):
    """k*page_size +- 1, k*chunk +- 1, a decode-side prefix hit and streaming, all at once;
    then bytes, pages and copy ops per room, the decode's prompt-token count and page baseline."""
    rng = random.Random(5)
    router, prefill, decode = pd["router"].url, pd["prefill"], pd["decode"]
    prefix = [rng.randrange(3, 440) for _ in range(41)]
    warm = _generate(router, prefix, 8)            # fills the decode's prefix cache
    lengths = sorted({1, 2, 3, 5, 7, 8, 9, 11, 15, 16, 17, 23, 31, 32, 33, 47, 63, 64, 65, 95,
                      96, 97, 127, 128, 129, 150, 181, 200, 223, 250})
    assert {PAGE_SIZE * 4 - 1, PAGE_SIZE * 4 + 1, CHUNK - 1, CHUNK + 1, 3 * CHUNK - 1,
            3 * CHUNK + 1} <= set(lengths)
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in lengths]
    prompts += [prefix[:40] + [rng.randrange(3, 440) for _ in range(9)],      # 49 tokens
                prefix[:40] + [rng.randrange(3, 440) for _ in range(30)]]     # 70 tokens
    assert len(prompts) == 32 and len({len(p) for p in prompts}) == 32
    max_new = [4 + (i * 5) % 13 for i in range(32)]
    p_metrics_before = get(prefill.url + "/metrics")[1]
    bytes_before = metric_value(p_metrics_before, "pdjax:kv_transfer_total_bytes_total",
                                role="prefill")
    # ~2400 prompt tokens for a 2048-token pool: the decode admits in waves and evicts its
    # prefix cache, so the two prefix-hit prompts go first, and the rest follow once the
    # decode has reserved their pages (a fixed sleep lost that race on a loaded machine).
    order = [30, 31] + list(range(30))
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = {}
        for i in order:
            futures[i] = pool.submit(_generate, router, prompts[i], max_new[i],
                                     stream=(i % 4 == 0))
            if i == 31:
                assert wait_until(lambda: _reserved(decode, {49, 70}), 60), pd_state(decode)
        results = [futures[i].result() for i in range(32)]
    ref = _reference(pd["colocated"], prompts, max_new)
    compared = sum(greedy_agrees(ids, top, res["output_ids"])
                   for (ids, top), res in zip(ref, results))
    assert compared >= 0.9 * sum(max_new)
    for res, p in zip(results, prompts):
        assert res["meta_info"]["prompt_tokens"] == len(p)

    # Per room (prefill side): what was sent is exactly the prompt minus the decode's prefix.
    # The router answers when the decode is done: wait for the prefill's last rooms to close.
    assert wait_until(lambda: at_baseline(prefill), 10)
    state = pd_state(prefill)
    by_len = _records_by_len(state)
    buffers, bpp = state["num_layer_buffers"], state["kv_bytes_per_page"]
    assert buffers == 2 * 2 and bpp == 2 * 2 * PAGE_SIZE * 2 * 16 * 4   # K,V x 2 layers, f32
    total_pages = total_copies = 0
    for p in prompts:
        (rec,) = by_len[len(p)]
        assert rec["state"] == "Success", rec
        prefix_pages = rec["decode_prefix_len"] // PAGE_SIZE
        pages = -(-len(p) // PAGE_SIZE) - prefix_pages
        runs = sum(count_runs(c["src"], c["dst"]) for c in rec["chunks"])
        assert rec["pages"] == pages == sum(len(c["src"]) for c in rec["chunks"])
        assert rec["bytes"] == pages * bpp
        assert rec["copies"] == runs * buffers
        assert rec["chunks"][-1]["last"] and not any(c["last"] for c in rec["chunks"][:-1])
        total_pages += pages
        total_copies += rec["copies"]
    # The decode-side prefix hit shrank both transfers by the 10 cached pages.
    assert by_len[49][0]["decode_prefix_len"] == 40 and by_len[70][0]["decode_prefix_len"] == 40
    assert by_len[49][0]["pages"] == 13 - 10 and by_len[70][0]["pages"] == 18 - 10
    # A fresh pool hands out consecutive pages: runs merge, so far fewer copies than pages.
    assert total_copies < total_pages * buffers / 2
    p_metrics = get(prefill.url + "/metrics")[1]
    moved = metric_value(p_metrics, "pdjax:kv_transfer_total_bytes_total", role="prefill")
    assert moved - bytes_before == total_pages * bpp
    assert metric_value(p_metrics, "pdjax:kv_transfer_copy_ops_total", role="prefill") == \
        sum(r["copies"] for r in state["recent"])
    assert state["engine"]["largest_batch"] <= state["max_batch"] == 1024
    d_metrics = get(decode.url + "/metrics")[1]
    assert metric_value(d_metrics, "pdjax:kv_transfer_pages_total", role="decode") == \
        sum(r["pages"] for r in state["recent"])
    assert "pdjax:kv_transfer_failed_total{" not in d_metrics + p_metrics

    # The decode never computed a prompt token; every page is back (cache pages evictable).
    assert warm["meta_info"]["completion_tokens"] == 8
    assert load(decode)["num_prompt_tokens_computed"] == 0
    assert metric_value(d_metrics, "pdjax:pd_prompt_tokens_computed", role="decode") == 0
    assert wait_until(lambda: at_baseline(prefill) and at_baseline(decode), 10)


def test_max_new_tokens_0_and_1_and_eos_first(pd):
    router, colocated = pd["router"].url, pd["colocated"]
    rng = random.Random(11)
    ids = [rng.randrange(3, 440) for _ in range(21)]
    # 0 new tokens: no token, as colocated (the prefill's first token was returned before).
    assert colocated.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})[
        "output_ids"] == []
    for stream in (False, True):
        out = _generate(router, ids, 0, stream=stream)
        assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    status, body = post(router + "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 0
    assert wait_until(lambda: at_baseline(pd["prefill"]) and at_baseline(pd["decode"]), 10)
    for stream in (False, True):
        out = _generate(router, ids, 1, stream=stream)
        assert len(out["output_ids"]) == 1
        assert out["output_ids"] == colocated.generate(
            input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1})["output_ids"]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    # A prompt whose greedy first token is EOS (searched with the colocated engine).
    cands = [[rng.randrange(3, 440) for _ in range(rng.randrange(1, 6))] for _ in range(4000)]
    firsts = colocated.generate(input_ids=cands, sampling_params={"temperature": 0,
                                                                  "max_new_tokens": 1})
    eos_prompt = next(c for c, o in zip(cands, firsts) if o["output_ids"] == [EOS])
    out = _generate(router, eos_prompt, 32)
    assert out["output_ids"] == [EOS]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["meta_info"]["completion_tokens"] == 1


def test_n2_and_batches_get_one_room_per_sample(pd):
    router, prefill, colocated = pd["router"].url, pd["prefill"], pd["colocated"]
    rng = random.Random(12)
    a = [rng.randrange(3, 440) for _ in range(133)]
    b = [rng.randrange(3, 440) for _ in range(134)]
    # The router answers when the decode is done; the prefill's room of an earlier request can
    # still be closing: wait for it, so that it is in the snapshot and not taken for a new one.
    assert wait_until(lambda: at_baseline(prefill), 10)
    rooms_before = {r["room"] for r in pd_state(prefill)["recent"]}
    status, outs = post(router + "/generate", {
        "input_ids": [a, b], "sampling_params": {"temperature": 0, "max_new_tokens": 6, "n": 2}})
    assert status == 200, outs
    assert len(outs) == 4
    ref = {len(p): colocated.generate(input_ids=p, sampling_params={
        "temperature": 0, "max_new_tokens": 6})["output_ids"] for p in (a, b)}
    for out in outs:
        assert out["output_ids"] == ref[out["meta_info"]["prompt_tokens"]]
    assert wait_until(lambda: at_baseline(prefill), 10)
    new = [r for r in pd_state(prefill)["recent"] if r["room"] not in rooms_before]
    assert sorted(r["prompt_len"] for r in new) == [133, 133, 134, 134]
    assert len({r["room"] for r in new}) == 4 and all(r["state"] == "Success" for r in new)


def test_logprobs_are_merged_from_prefill(pd):
    router, colocated = pd["router"].url, pd["colocated"]
    ids = list(range(40, 77))
    ref = colocated.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 5},
                             return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    for stream in (False, True):
        out = _generate(router, ids, 5, stream=stream, return_logprob=True, logprob_start_len=0,
                        top_logprobs_num=2)
        meta, rmeta = out["meta_info"], ref["meta_info"]
        assert out["output_ids"] == ref["output_ids"]
        got_in = meta["input_token_logprobs"]
        assert len(got_in) == len(ids) and got_in[0][0] is None
        for (lp, tok, _), ref_lp in zip(got_in[1:], rmeta["input_token_logprobs"][1:]):
            assert abs(lp - ref_lp) < 1e-4
        assert [t for _, t, _ in got_in] == ids
        for (lp, tok, _), (rlp, rtok, _) in zip(meta["output_token_logprobs"],
                                                rmeta["output_token_logprobs"]):
            assert tok == rtok and abs(lp - rlp) < 1e-4
        assert len(meta["output_top_logprobs"][0]) == 2


def test_constrained_requests_equal_colocated(pd):
    """The prefill's first token is drawn under the grammar; the decode builds its own matcher
    from the request, takes the first token and goes on: the same tokens as colocated."""
    import json
    import re

    import jsonschema

    router, colocated = pd["router"].url, pd["colocated"]
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0,
                                                         "maximum": 99}},
        "required": ["name", "n"], "additionalProperties": False}
    ids = list(range(60, 80))
    cases = [{"temperature": 0, "json_schema": json.dumps(schema)},
             {"temperature": 1.0, "seed": 9, "json_schema": json.dumps(schema)},
             {"temperature": 1.0, "seed": 4, "regex": r"[a-z]{1,5}@[0-9]{2}"}]
    for sp in cases:
        sp = dict(sp, max_new_tokens=60)
        ref = colocated.generate(input_ids=ids, sampling_params=sp)
        for stream in (False, True):
            body = {"input_ids": ids, "sampling_params": sp}
            if stream:
                status, events = post_stream(router + "/generate", dict(body, stream=True))
                out = events[-1]
            else:
                status, out = post(router + "/generate", body)
            assert status == 200, out
            assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"], sp
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
        if "regex" in sp:
            assert re.fullmatch(sp["regex"], ref["text"])
        else:
            jsonschema.validate(json.loads(ref["text"]), schema)
    for s in ("prefill", "decode"):
        assert wait_until(lambda: at_baseline(pd[s]), 10), s


def test_logit_bias_applies_to_the_prefills_first_token(pd):
    """The prefill draws the first token with the bias, the decode the rest: the same tokens as
    colocated, through /generate and /v1/completions; a bad bias is a 400 from the router."""
    router, colocated = pd["router"].url, pd["colocated"]
    ids = list(range(90, 111))
    plain = colocated.generate(input_ids=ids, sampling_params={"temperature": 0,
                                                               "max_new_tokens": 5})
    first = plain["output_ids"][0]
    cases = [{"temperature": 0, "logit_bias": {str(first): -100, "33": 4.5}},
             {"temperature": 0, "logit_bias": {"77" if first != 77 else "78": 100}},
             {"temperature": 1.0, "seed": 5, "logit_bias": {str(first): -100, "40": 3}}]
    for sp in cases:
        sp = dict(sp, max_new_tokens=5)
        ref = colocated.generate(input_ids=ids, sampling_params=sp)
        assert ref["output_ids"][0] != first
        for stream in (False, True):
            out = _generate(router, ids, 5, stream=stream, sampling_params=sp)
            assert out["output_ids"] == ref["output_ids"], (sp, stream)
        status, comp = post(router + "/v1/completions", {
            "prompt": ids, "max_tokens": 5, "temperature": sp["temperature"],
            "seed": sp.get("seed"), "logit_bias": sp["logit_bias"]})
        assert status == 200, comp
        assert comp["choices"][0]["text"] == ref["text"]
    assert ref["output_ids"]
    status, err = post(router + "/v1/completions", {"prompt": ids, "max_tokens": 2,
                                                     "logit_bias": {"100000": 1}})
    assert status == 400 and "logit_bias" in json.dumps(err), err
    for s in ("prefill", "decode"):
        assert wait_until(lambda: at_baseline(pd[s]), 10), s


def test_min_new_tokens_holds_back_the_prefills_first_stop_token(pd):
    """min_new_tokens >= 1: the prefill draws its first token with the stop tokens held back
    (EOS, stop_token_ids), the decode the rest below min_new_tokens: the same tokens as
    colocated, through /generate and /v1/completions (min_tokens); stop_regex ends the
    decode's text as colocated."""
    router, colocated = pd["router"].url, pd["colocated"]
    rng = random.Random(21)
    cands = [[rng.randrange(3, 440) for _ in range(rng.randrange(1, 6))] for _ in range(4000)]
    firsts = colocated.generate(input_ids=cands, sampling_params={"temperature": 0,
                                                                  "max_new_tokens": 1})
    eos_prompt = next(c for c, o in zip(cands, firsts) if o["output_ids"] == [EOS])
    ids = list(range(120, 141))
    first = colocated.generate(input_ids=ids, sampling_params={
        "temperature": 0, "max_new_tokens": 1})["output_ids"][0]
    cases = [(eos_prompt, {"temperature": 0, "min_new_tokens": 3}),
             (ids, {"temperature": 0, "stop_token_ids": [first], "min_new_tokens": 2}),
             (ids, {"temperature": 1.0, "seed": 3, "stop_token_ids": [first],
                    "min_new_tokens": 4})]
    for prompt, sp in cases:
        sp = dict(sp, max_new_tokens=6)
        ref = colocated.generate(input_ids=prompt, sampling_params=sp)
        held = set(sp.get("stop_token_ids", [])) | {EOS}
        assert not held & set(ref["output_ids"][:sp["min_new_tokens"]]), ref["output_ids"]
        for stream in (False, True):
            out = _generate(router, prompt, 6, stream=stream, sampling_params=sp)
            assert out["output_ids"] == ref["output_ids"], (sp, stream)
        comp_sp = {k: v for k, v in sp.items() if k not in ("max_new_tokens", "min_new_tokens")}
        status, comp = post(router + "/v1/completions", {
            "prompt": prompt, "max_tokens": 6, "min_tokens": sp["min_new_tokens"], **comp_sp})
        assert status == 200, comp
        assert comp["choices"][0]["text"] == ref["text"]
    # stop_regex: the decode's text ends before the first match, as colocated.
    plain = colocated.generate(input_ids=ids, sampling_params={"temperature": 0,
                                                               "max_new_tokens": 8})
    tok = colocated.tokenizer
    piece = next((tok.decode([t]) for t in plain["output_ids"][2:]
                  if "\ufffd" not in tok.decode([t]) and tok.decode([t]).strip()), None)
    if piece is not None:
        import re

        sp = {"temperature": 0, "max_new_tokens": 8, "stop_regex": re.escape(piece)}
        ref = colocated.generate(input_ids=ids, sampling_params=sp)
        assert ref["meta_info"]["finish_reason"] == {"type": "stop", "matched": sp["stop_regex"]}
        out = _generate(router, ids, 8, sampling_params=sp)
        assert (out["text"], out["meta_info"]["finish_reason"]) == \
            (ref["text"], ref["meta_info"]["finish_reason"])
    status, err = post(router + "/v1/completions", {"prompt": ids, "max_tokens": 2,
                                                     "min_tokens": 3})
    assert status == 400 and "min_tokens" in json.dumps(err), err
    for s in ("prefill", "decode"):
        assert wait_until(lambda: at_baseline(pd[s]), 10), s


def test_auto_tool_choice_through_the_router_gives_tool_calls(pd):
    """A logit bias makes the prefill's first token and every decode token the call token: the
    decode's answer carries the call as ``tool_calls`` (tool_choice "auto"), whole and
    streamed; without the bias, no call."""
    router = pd["router"].url
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    body = {"messages": [{"role": "user", "content": "Add 7 and 35."}], "tools": tools,
            "tool_choice": "auto", "max_tokens": 3, "temperature": 0,
            "logit_bias": {str(pd["call_id"]): 100}, "stop": ["\n<tool_call>"]}
    status, chat = post(router + "/v1/chat/completions", body)
    assert status == 200, chat
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"a": 7, "b": 35}
    status, events = post_stream(router + "/v1/chat/completions", body)
    assert status == 200, events
    deltas = [tc for e in events for c in e.get("choices", [])
              for tc in (c.get("delta") or {}).get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "add"
    args = "".join(tc["function"].get("arguments") or "" for tc in deltas)
    assert json.loads(args) == {"a": 7, "b": 35}
    assert [c["finish_reason"] for e in events for c in e.get("choices", [])
            if c.get("finish_reason")] == ["tool_calls"]
    status, chat = post(router + "/v1/chat/completions",
                        dict(body, logit_bias=None, max_tokens=6, stop=None))
    assert status == 200 and not chat["choices"][0]["message"].get("tool_calls"), chat
    for s in ("prefill", "decode"):
        assert wait_until(lambda: at_baseline(pd[s]), 10), s


def test_health_generate_uses_the_fake_transfer(pd):
    for server in (pd["prefill"], pd["decode"]):
        status, body = get(server.url + "/health_generate")
        assert status == 200, body
    info = get(pd["prefill"].url + "/get_server_info")[1]
    assert info["disaggregation_mode"] == "prefill"
    assert get(pd["decode"].url + "/get_server_info")[1]["disaggregation_mode"] == "decode"
    assert wait_until(lambda: at_baseline(pd["prefill"]) and at_baseline(pd["decode"]), 10)


@pytest.fixture(scope="module")
def sglang_router(pd):
    port = free_port()
    server = Server("sglang-router", [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", pd["prefill"].url, str(pd["bport"]), "--decode", pd["decode"].url,
        "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
        "--log-level", "warn"], port, pd["logs"], child_env())
    try:
        server.wait_healthy(120)
        yield server
    except BaseException:
        print(f"==== sglang-router log ====\n{server.log_tail(80)}")
        raise
    finally:
        server.stop()


def test_sglang_router_in_front_of_the_same_servers(pd, sglang_router):
    url, colocated = sglang_router.url, pd["colocated"]
    rng = random.Random(13)
    ids = [rng.randrange(3, 440) for _ in range(45)]
    ref = colocated.generate(input_ids=ids, sampling_params={"temperature": 0,
                                                             "max_new_tokens": 7})["output_ids"]
    assert _generate(url, ids, 7)["output_ids"] == ref
    assert _generate(url, ids, 7, stream=True)["output_ids"] == ref
    # n = 2: sglang-router sends one scalar room; the servers give sample k room + k.
    status, outs = post(url + "/generate", {
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 7, "n": 2}})
    assert status == 200, outs
    assert [o["output_ids"] for o in outs] == [ref, ref]
    # A batch of token-id prompts: one room per prompt (lists).
    status, outs = post(url + "/generate", {
        "input_ids": [ids, ids[:30]], "sampling_params": {"temperature": 0, "max_new_tokens": 7}})
    assert status == 200, outs
    assert outs[0]["output_ids"] == ref
    # Chat, n = 2, plain and streamed, equals the pdjax router's answer.
    model = get(url + "/v1/models")[1]["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Once upon a time"}],
            "max_tokens": 9, "temperature": 0, "n": 2}
    status, ours = post(pd["router"].url + "/v1/chat/completions", chat)
    assert status == 200, ours
    status, theirs = post(url + "/v1/chat/completions", chat)
    assert status == 200, theirs
    texts = [c["message"]["content"] for c in theirs["choices"]]
    assert texts == [c["message"]["content"] for c in ours["choices"]] and len(texts) == 2
    assert theirs["usage"]["completion_tokens"] == ours["usage"]["completion_tokens"]
    status, events = post_stream(url + "/v1/chat/completions", chat)
    assert status == 200, events
    streamed = collections.defaultdict(str)
    for e in events:
        for c in e.get("choices", []):
            streamed[c["index"]] += c["delta"].get("content") or ""
    assert [streamed[0], streamed[1]] == texts
    assert wait_until(lambda: at_baseline(pd["prefill"]) and at_baseline(pd["decode"]), 10)
    assert load(pd["decode"])["num_prompt_tokens_computed"] == 0
