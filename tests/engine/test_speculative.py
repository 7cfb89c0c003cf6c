"""Speculative decoding end to end (n-gram drafts, DESIGN.md §3 "Speculative decoding"): greedy
tokens equal those without speculation (tie-aware, DESIGN.md §5) on the tiny Llama, colocated,
with prefill chunks and verify rows in one forward, and after a prefix-cache hit; pages all
come back; no compile after warm-up; the per-request opt-out; ``meta_info`` fields."""

import numpy as np
import pytest

from conftest import CHUNK_BIG, PAGE
from model_utils import (TINY_TOKENIZER_VOCAB, assert_tokens_match, set_sched,
                         top2_gaps_from_top_logprobs)
from pdjax.engine import Engine
from pdjax.runner.model_runner import compile_count

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec_engine(tiny_checkpoints, llama_engine):
    """The tiny Llama with n-gram speculation, settings as ``llama_engine`` (the reference)."""
    eng = Engine(tiny_checkpoints["llama"], dtype="float32", page_size=PAGE,
                 max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=CHUNK_BIG,
                 context_length=128, progress=False, speculative_algorithm="ngram",
                 speculative_num_draft_tokens=4, speculative_ngram_min_match_window_size=1,
                 speculative_disable_by_batch_size=16)
    base = eng.core.sched_config
    yield eng
    set_sched(eng, **{k: getattr(base, k) for k in ("chunked_prefill_size", "enable_mixed_chunk")})
    eng.shutdown()


def _prompts(n, seed, lengths=(20, 37, 9, 52, 15, 30, 44, 26)):
    """Prompts made of a repeated random pattern (so the n-gram drafter finds matches and the
    tiny random model's greedy output loops) with a random tail."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pat = rng.integers(3, TINY_TOKENIZER_VOCAB, int(rng.integers(3, 8))).tolist()
        body = (pat * 20)[:lengths[i % len(lengths)]]
        out.append(body + rng.integers(3, TINY_TOKENIZER_VOCAB, 2).tolist())
    return out


def _reference(llama_engine, prompts, params=GREEDY):
    set_sched(llama_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=False)
    llama_engine.core.scheduler.prefix_cache.reset()
    return llama_engine.generate(input_ids=prompts, sampling_params=params,
                                 return_logprob=True, top_logprobs_num=2)


def _check_same(ours, ref):
    for o, r in zip(ours, ref):
        gaps = top2_gaps_from_top_logprobs(r["meta_info"]["output_top_logprobs"])
        assert_tokens_match(o["output_ids"], r["output_ids"], gaps, what="speculative")
        assert len(o["output_ids"]) == len(r["output_ids"])


def _pool_is_whole(eng):
    sched = eng.core.scheduler
    sched.check_invariants()
    assert not sched.running and not sched.waiting
    assert sched.allocator.num_free + len(sched.prefix_cache.cached_pages()) == \
        sched.config.num_pages - 1
    assert eng.core.flush_cache() and sched.allocator.num_free == sched.config.num_pages - 1


def test_greedy_tokens_equal_without_speculation(spec_engine, llama_engine):
    prompts = _prompts(8, seed=1)
    ref = _reference(llama_engine, prompts)
    stats = spec_engine.core.speculator.stats
    rows0, acc0 = stats.num_verify_rows, stats.num_accepted_tokens
    before, late = compile_count(), spec_engine.core.runner.compiles_after_warmup
    out = spec_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    _check_same(out, ref)
    # Speculation ran and kept drafts: fewer forwards than tokens.
    assert stats.num_verify_rows > rows0 and stats.num_accepted_tokens - acc0 > 20
    metas = [o["meta_info"] for o in out]
    assert sum(m.get("spec_verify_ct", 0) for m in metas) == stats.num_verify_rows - rows0
    assert all(m["spec_accept_len"] >= 1.0 for m in metas if "spec_verify_ct" in m)
    assert compile_count() == before and spec_engine.core.runner.compiles_after_warmup == late
    _pool_is_whole(spec_engine)


def test_prefill_chunks_and_verify_rows_share_a_forward(spec_engine, llama_engine):
    prompts = _prompts(8, seed=2, lengths=(10, 90, 12, 70, 8, 100, 14, 60))
    ref = _reference(llama_engine, prompts)
    set_sched(spec_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    spec_engine.core.scheduler.prefix_cache.reset()
    mixed = []
    hook = lambda batch, outs: mixed.append(  # noqa: E731
        any(r.is_verify for r in batch.rows)
        and any(not r.is_verify and not r.is_decode for r in batch.rows))
    spec_engine.core.step_hooks.append(hook)
    before = compile_count()
    try:
        out = spec_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    finally:
        spec_engine.core.step_hooks.remove(hook)
    assert sum(mixed) >= 2, "no forward held both a prefill chunk and a verify row"
    _check_same(out, ref)
    assert compile_count() == before
    _pool_is_whole(spec_engine)


def test_prefix_hit_and_opt_out(spec_engine, llama_engine):
    prompts = _prompts(4, seed=3, lengths=(40, 33, 48, 25))
    ref = _reference(llama_engine, prompts)
    set_sched(spec_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=False)
    first = spec_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    again = spec_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert all(o["meta_info"]["cached_tokens"] >= PAGE for o in again)
    _check_same(first, ref)
    _check_same(again, ref)
    off = spec_engine.generate(input_ids=prompts, sampling_params={**GREEDY, "speculative": False})
    assert all("spec_verify_ct" not in o["meta_info"] for o in off)
    _check_same(off, ref)
    _pool_is_whole(spec_engine)


def test_sampled_requests_speculate_and_finish(spec_engine):
    """Sampled rows (temperature, top-k/p, penalties, seeds) go through verify rows too; the
    output distribution is checked at the sampler level (tests/runner/test_verify.py)."""
    prompts = _prompts(6, seed=4)
    params = [{"max_new_tokens": 20, "temperature": 0.7, "top_k": 20, "top_p": 0.9,
               "seed": 100 + i, "ignore_eos": True,
               **({"frequency_penalty": 0.5, "repetition_penalty": 1.1} if i % 2 else {})}
              for i in range(len(prompts))]
    a = spec_engine.generate(input_ids=prompts, sampling_params=params)
    b = spec_engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]      # seeded
    assert all(len(o["output_ids"]) == 20 for o in a)
    assert all(0 <= t < 512 for o in a for t in o["output_ids"])
    _pool_is_whole(spec_engine)


def test_grammar_rows_beside_prefill_chunks_on_a_speculating_engine(spec_engine, llama_engine):
    """Grammar rows that do not speculate, overlapped, have their draw split (``resample``)
    over the forward's logits rows, which an extend bucket of a speculating engine has more of
    than request rows (a bug: the split draw was built for the request rows)."""
    import re

    regex = r"[a-z]{3}-[0-9]{2}"
    prompts = _prompts(3, seed=6, lengths=(12, 100, 15))
    params = [{"max_new_tokens": 12, "temperature": 0, "regex": regex, "speculative": False},
              {**GREEDY, "speculative": False},
              {"max_new_tokens": 12, "temperature": 0, "regex": regex, "speculative": False}]
    set_sched(llama_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=True)
    llama_engine.core.scheduler.prefix_cache.reset()
    ref = llama_engine.generate(input_ids=prompts, sampling_params=params)
    set_sched(spec_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=True)
    split0 = spec_engine.core.num_grammar_split_steps
    out = spec_engine.generate(input_ids=prompts, sampling_params=params)
    assert spec_engine.core.num_grammar_split_steps > split0
    for o, r, p in zip(out, ref, params):
        if "regex" in p:
            assert re.fullmatch(regex, o["text"]), o["text"]
        assert o["output_ids"] == r["output_ids"]
    _pool_is_whole(spec_engine)


def test_a_verify_row_failing_to_sample_fails_alone(spec_engine, llama_engine):
    """A speculating request whose sampling raises mid-run (a seed set past validation) gets
    an error; the verify rows after it in the batch keep their own logits rows (tokens equal
    plain decoding) and every page comes back."""
    from pdjax.engine_io import GenerateRequest
    from pdjax.request import SamplingParams

    prompts = _prompts(3, seed=7, lengths=(30, 41, 26))
    ref = _reference(llama_engine, prompts)
    sched = set_sched(spec_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=False)
    sched.prefix_cache.reset()
    core = spec_engine.core
    sp = SamplingParams(**GREEDY)
    reqs = [core.add_request(GenerateRequest(f"f{i}", p, sp)) for i, p in enumerate(prompts)]
    spec = core.speculator
    propose = spec.propose

    def propose_then_break_f0(batch_reqs, max_tokens):
        # Break f0 in a step where it and a request after it both carry drafts.
        drafts = propose(batch_reqs, max_tokens)
        got = {r.rid: d for r, d in zip(batch_reqs, drafts)}
        if got.get("f0") and any(got.get(rid) for rid in ("f1", "f2")):
            reqs[0].seed_for_sampling = -5
        return drafts

    spec.propose = propose_then_break_f0
    outs = {}
    try:
        while sched.has_work:
            for out in core.step():
                outs.setdefault(out.rid, []).append(out)
            sched.check_invariants()
    finally:
        del spec.propose
    assert reqs[0].seed_for_sampling == -5
    assert outs["f0"][-1].finished and "sampling failed" in outs["f0"][-1].error
    for i in (1, 2):
        got = [t for o in outs[f"f{i}"] for t in o.new_token_ids]
        gaps = top2_gaps_from_top_logprobs(ref[i]["meta_info"]["output_top_logprobs"])
        assert_tokens_match(got, ref[i]["output_ids"], gaps, what="beside a failed row")
        assert len(got) == GREEDY["max_new_tokens"] and outs[f"f{i}"][-1].error is None
    assert outs["f1"][-1].spec_verify_ct > 0
    core.drain()
    _pool_is_whole(spec_engine)


def test_logprob_requests_speculate_with_the_same_logprobs(spec_engine, llama_engine):
    """Token logprobs and top logprobs of a verify row's emitted tokens are those of the
    logits rows they were drawn from: equal to plain decoding's (1e-4)."""
    prompts = _prompts(4, seed=8)
    ref = _reference(llama_engine, prompts)
    set_sched(spec_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=False)
    spec_engine.core.scheduler.prefix_cache.reset()
    out = spec_engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                               top_logprobs_num=2)
    _check_same(out, ref)
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in out) > 0
    for o, r in zip(out, ref):
        if o["output_ids"] != r["output_ids"]:
            continue                      # a near-tie (checked above); logprobs differ after
        la = np.array([x[0] for x in r["meta_info"]["output_token_logprobs"]])
        lb = np.array([x[0] for x in o["meta_info"]["output_token_logprobs"]])
        assert la.shape == lb.shape and np.abs(la - lb).max() < 1e-4
        assert [[t for _, t, _ in top] for top in o["meta_info"]["output_top_logprobs"]] == \
            [[t for _, t, _ in top] for top in r["meta_info"]["output_top_logprobs"]]
    _pool_is_whole(spec_engine)



def test_grammar_requests_speculate_within_their_grammar(spec_engine, llama_engine):
    """A grammar request's verify row has one mask per position, each after the drafts before
    it (the matcher advanced and rolled back): output as without speculation, matching the
    regex, with drafts accepted."""
    import re

    regex = r"(ab|cd|ef)( (ab|cd|ef)){4,9}"
    prompts = _prompts(4, seed=9)
    params = [{"max_new_tokens": 64, "temperature": 0, "regex": regex}] * 2 + \
        [{"max_new_tokens": 64, "temperature": 0.8, "seed": 5, "regex": regex}] * 2
    set_sched(llama_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=False)
    llama_engine.core.scheduler.prefix_cache.reset()
    ref = llama_engine.generate(input_ids=prompts, sampling_params=params)
    set_sched(spec_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=False)
    spec_engine.core.scheduler.prefix_cache.reset()
    stats = spec_engine.core.speculator.stats
    acc0 = stats.num_accepted_tokens
    out = spec_engine.generate(input_ids=prompts, sampling_params=params)
    for o, r in zip(out, ref):
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch(regex, o["text"]), o["text"]
        assert o["output_ids"] == r["output_ids"]
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in out) > 0
    assert stats.num_accepted_tokens > acc0
    _pool_is_whole(spec_engine)


def test_min_new_tokens_rejects_drafted_stop_tokens(spec_engine, llama_engine):
    """A stop token the looping greedy output keeps producing is held back below
    min_new_tokens on a speculating engine: verify rows run and the tokens equal those of the
    engine without speculation under the same params; past min_new_tokens it stops the
    request again. (The drafter here learns from the held-back output and rarely proposes the
    stop token: the rejection of a drafted stop token is checked on the device sampler,
    tests/runner/test_verify.py.)"""
    prompts = _prompts(4, seed=6, lengths=(40, 33, 48, 25))
    ref = _reference(llama_engine, prompts)
    params = []
    for r in ref:
        ids = r["output_ids"]
        stop = next((t for t in ids[1:] if ids.count(t) >= 3), ids[1])   # recurs in the loop
        params.append({**GREEDY, "stop_token_ids": [stop], "min_new_tokens": 12})
    held_ref = _reference(llama_engine, prompts, params)
    stats = spec_engine.core.speculator.stats
    rows0, acc0 = stats.num_verify_rows, stats.num_accepted_tokens
    before = compile_count()
    set_sched(spec_engine, chunked_prefill_size=CHUNK_BIG, enable_mixed_chunk=False)
    out = spec_engine.generate(input_ids=prompts, sampling_params=params)
    assert stats.num_verify_rows > rows0 and stats.num_accepted_tokens > acc0
    for o, r, p in zip(out, held_ref, params):
        stop = p["stop_token_ids"][0]
        assert stop not in o["output_ids"][:12] and len(o["output_ids"]) >= 12
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            assert o["output_ids"][-1] == stop
    _check_same(out, held_ref)
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in out)
    assert compile_count() == before
    _pool_is_whole(spec_engine)
