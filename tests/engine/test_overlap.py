"""Overlapped scheduling (the default) gives what the synchronous loop gives
(``--disable-overlap-schedule``): greedy and seeded tokens, logprobs, stop strings and tokens,
``max_new_tokens`` 1 and 2, streaming order, aborts mid-stream, retraction; no token past a
finish ever reaches a client; no compile after warm-up."""

import numpy as np

from model_utils import (TINY_TOKENIZER_VOCAB, assert_tokens_match, boundary_prompts, set_sched,
                         top2_gaps_from_top_logprobs)
from pdjax.engine_io import GenerateRequest
from pdjax.request import PENDING_TOKEN, SamplingParams
from pdjax.runner.model_runner import compile_count

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _both(overlap, fn):
    return fn(overlap(False)), fn(overlap(True))


def _gen(eng, prompts, params, **kw):
    return eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                        top_logprobs_num=3, **kw)


def _exactly_equal(off, on):
    for a, b in zip(off, on):
        assert b["output_ids"] == a["output_ids"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        assert b["meta_info"]["completion_tokens"] == a["meta_info"]["completion_tokens"]
        assert b["text"] == a["text"]
        la = np.array([x[0] for x in a["meta_info"]["output_token_logprobs"]])
        lb = np.array([x[0] for x in b["meta_info"]["output_token_logprobs"]])
        assert la.shape == lb.shape and np.abs(la - lb).max(initial=0) < 1e-5
        assert [[t for _, t, _ in top] for top in b["meta_info"]["output_top_logprobs"]] == \
            [[t for _, t, _ in top] for top in a["meta_info"]["output_top_logprobs"]]


def test_greedy_seeded_logprobs_and_lengths_equal(llama_engine, overlap):
    set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    prompts = boundary_prompts(10, seed=21)
    rng = np.random.default_rng(21)
    params = []
    for i in range(len(prompts)):
        sp = {"max_new_tokens": [1, 2, 5, 9][i % 4], "ignore_eos": True}
        if i % 2:
            sp.update(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=int(rng.integers(1 << 62)),
                      repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
        else:
            sp.update(temperature=0)
        params.append(sp)
    # logprob_start_len must be below every prompt's length (one prompt has 1 token)
    off, on = _both(overlap, lambda e: _gen(e, prompts, params, logprob_start_len=0))
    _exactly_equal(off, on)
    assert [len(o["output_ids"]) for o in on] == [p["max_new_tokens"] for p in params]
    assert sum(len(o["meta_info"]["input_token_logprobs"]) for o in on) > 50
    for a, b in zip(off, on):
        ia, ib = a["meta_info"]["input_token_logprobs"], b["meta_info"]["input_token_logprobs"]
        assert len(ia) == len(ib)
        assert all((x is None and y is None) or abs(x - y) < 1e-5 for x, y in zip(ia, ib))


def test_stop_tokens_and_stop_strings_equal(llama_engine, overlap):
    set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    eng = llama_engine
    prompts = boundary_prompts(6, seed=22)
    free = _gen(overlap(False), prompts, {**GREEDY, "max_new_tokens": 12})
    params, stops = [], []
    for o in free:
        toks = o["output_ids"]
        params.append({**GREEDY, "max_new_tokens": 12, "stop_token_ids": [toks[3]]})
        text = eng.tokenizer.decode(toks[5:7])
        stops.append({**GREEDY, "max_new_tokens": 12, "stop": [text]} if text.strip() else
                     {**GREEDY, "max_new_tokens": 12})
    off, on = _both(overlap, lambda e: _gen(e, prompts, params))
    for a, b, f in zip(off, on, free):
        gaps = top2_gaps_from_top_logprobs(a["meta_info"]["output_top_logprobs"])
        assert_tokens_match(b["output_ids"], a["output_ids"], gaps, what="stop token")
        assert a["meta_info"]["finish_reason"]["type"] == "stop"
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
    off, on = _both(overlap, lambda e: _gen(e, prompts, stops))
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in off)
    for a, b in zip(off, on):
        assert (b["text"], b["meta_info"]["finish_reason"]) == (a["text"], a["meta_info"]["finish_reason"])
        assert b["output_ids"] == a["output_ids"]


def _stream(core, reqs, abort_after=None):
    """Drive ``core.step()``; per rid the list of (new tokens, completion_tokens, finished).
    ``abort_after = (rid, n)`` aborts ``rid`` once ``n`` of its tokens were streamed."""
    for g in reqs:
        core.add_request(g)
    got = {g.rid: [] for g in reqs}
    in_flight = 0
    while core.has_work:
        outs = core.step()
        in_flight += core._inflight is not None and core._inflight.num_placeholders > 0
        for out in outs:
            assert not (got[out.rid] and got[out.rid][-1][2]), f"{out.rid}: output after finish"
            assert PENDING_TOKEN not in out.new_token_ids
            got[out.rid].append((out.new_token_ids, out.completion_tokens, out.finished))
            if abort_after and out.rid == abort_after[0] and out.completion_tokens == abort_after[1]:
                aborted = core.abort_request(out.rid)
                got[out.rid].append((aborted.new_token_ids, aborted.completion_tokens, aborted.finished))
        core.scheduler.check_invariants()
    assert (in_flight > 5) == core.overlap      # decode rows really waited on placeholders
    return got


def _requests(prompts, sp, tag):
    return [GenerateRequest(f"{tag}{i}", p, SamplingParams(**sp)) for i, p in enumerate(prompts)]


def test_streaming_order_and_abort_mid_stream_equal(llama_engine, overlap):
    sched = set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    prompts = boundary_prompts(5, seed=23)
    sp = {"max_new_tokens": 7, "temperature": 0.8, "seed": 5, "ignore_eos": True}
    runs = []
    for on in (False, True):
        core = overlap(on).core
        got = _stream(core, _requests(prompts, sp, "s"), abort_after=("s2", 3))
        runs.append((got, sched.prefix_cache.num_cached_pages))
        assert not sched.running and sched.num_used_pages == sched.prefix_cache.num_cached_pages
    (off, cached_off), (on, cached_on) = runs
    assert on == off
    assert cached_on == cached_off            # the abort released the same pages into the cache
    for rid, outs in on.items():
        counts = [c for _, c, _ in outs]
        assert counts == sorted(counts) and outs[-1][2]
        if rid == "s2":
            assert sum(len(t) for t, _, _ in outs) == 3 and outs[-1][0] == []
        else:
            assert [len(t) for t, _, _ in outs] == [1] * 7 and counts == list(range(1, 8))


def test_retraction_equal(llama_engine, overlap):
    prompts = boundary_prompts(12, seed=24)
    params = [{**GREEDY, "max_new_tokens": 30}] * 6 + \
        [{"max_new_tokens": 30, "temperature": 1.0, "seed": 40 + i, "ignore_eos": True} for i in range(6)]
    runs = []
    for on in (False, True):
        sched = set_sched(llama_engine, chunked_prefill_size=16, num_pages=16, enable_mixed_chunk=True)
        runs.append(_gen(overlap(on), prompts, params))
        assert sched.num_retractions > 0
        assert not sched.running and sched.num_used_pages == sched.prefix_cache.num_cached_pages
    _exactly_equal(*runs)


def test_200_random_requests_no_compile_with_overlap(llama_engine, overlap):
    set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    eng = overlap(True)
    rng = np.random.default_rng(25)
    prompts = [[int(x) for x in rng.integers(3, TINY_TOKENIZER_VOCAB, rng.integers(1, 100))]
               for _ in range(200)]
    params = []
    for _ in prompts:
        sp = {"max_new_tokens": int(rng.integers(1, 16)), "ignore_eos": bool(rng.integers(2)),
              "temperature": float(rng.choice([0, 0.7, 1.2]))}
        if rng.integers(2):
            sp.update(top_k=int(rng.integers(1, 50)), top_p=float(rng.uniform(0.5, 1.0)),
                      min_p=float(rng.uniform(0, 0.2)), seed=int(rng.integers(1 << 40)))
        if rng.integers(3) == 0:
            sp.update(repetition_penalty=float(rng.uniform(0.8, 1.5)),
                      frequency_penalty=float(rng.uniform(-1, 1)), presence_penalty=0.5)
        if rng.integers(4) == 0:
            sp["stop_token_ids"] = [int(rng.integers(3, 500))]
        params.append(sp)
    before, before_engine = compile_count(), eng.core.runner.compiles_after_warmup
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                        top_logprobs_num=int(rng.integers(0, 5)))
    assert compile_count() == before
    assert eng.core.runner.compiles_after_warmup == before_engine
    for o, p in zip(outs, params):
        assert 1 <= len(o["output_ids"]) <= p["max_new_tokens"]
        if o["meta_info"]["finish_reason"]["type"] == "length":
            assert len(o["output_ids"]) == p["max_new_tokens"]
    sched = eng.core.scheduler
    assert not sched.running and sched.num_used_pages == sched.prefix_cache.num_cached_pages
