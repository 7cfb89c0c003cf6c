"""The same workload gives the same tokens and logprobs under every scheduling choice:
chunk size, mixed batches, prefix-cache hits, a KV pool too small for the load; no compile
after warm-up; seeded sampling independent of the batch."""

import numpy as np
import pytest

from model_utils import TINY_TOKENIZER_VOCAB, assert_output_agrees, boundary_prompts, set_sched
from pdjax.runner.model_runner import compile_count

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def _run(engine, prompts, params=GREEDY, modes=None, check=False):
    core = engine.core

    def hook(batch, outputs):
        if modes is not None:
            modes.append(batch.forward_mode)
        if check:
            core.scheduler.check_invariants()

    core.step_hooks.append(hook)
    try:
        return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                               top_logprobs_num=2)
    finally:
        core.step_hooks.remove(hook)


def _assert_same(ref_outs, outs, what):
    for i, (a, b) in enumerate(zip(ref_outs, outs)):
        assert_output_agrees(a, b, f"{what} prompt {i}")


def test_chunked_mixed_and_prefix_hit_agree(llama_engine):
    prompts = boundary_prompts(16, seed=1)
    set_sched(llama_engine, chunked_prefill_size=64, disable_radix_cache=True)
    ref = _run(llama_engine, prompts)

    set_sched(llama_engine, chunked_prefill_size=16, disable_radix_cache=True)
    modes = []
    _assert_same(ref, _run(llama_engine, prompts, modes=modes, check=True), "chunk 16")
    assert "mixed" not in modes and "decode" in modes

    set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True, disable_radix_cache=True)
    modes = []
    _assert_same(ref, _run(llama_engine, prompts, modes=modes, check=True), "mixed")
    assert modes.count("mixed") >= 3

    sched = set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    cold = _run(llama_engine, prompts, check=True)
    _assert_same(ref, cold, "radix cold")
    assert sum(o["meta_info"]["cached_tokens"] for o in cold) == 0
    assert sched.prefix_cache.num_cached_pages > 0
    hit = _run(llama_engine, prompts, check=True)
    _assert_same(ref, hit, "radix hit")
    cached = [o["meta_info"]["cached_tokens"] for o in hit]
    # Every prompt with at least one full page before its last token hits the cache.
    assert all(c == (len(p) - 1) // 8 * 8 for c, p in zip(cached, prompts)), cached


def test_small_pool_completes_with_same_tokens(llama_engine):
    prompts = boundary_prompts(12, seed=2)
    params = {**GREEDY, "max_new_tokens": 40}
    set_sched(llama_engine, chunked_prefill_size=16)
    ref = _run(llama_engine, prompts, params)
    sched = set_sched(llama_engine, chunked_prefill_size=16, num_pages=16, enable_mixed_chunk=True)
    outs = _run(llama_engine, prompts, params, check=True)
    assert sched.num_retractions > 0
    _assert_same(ref, outs, "small pool")
    assert all(len(o["output_ids"]) == 40 for o in outs)
    assert not sched.running and sched.num_used_pages == sched.prefix_cache.num_cached_pages


def test_100_requests_trigger_no_compile_after_warmup(llama_engine):
    set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(3, TINY_TOKENIZER_VOCAB, rng.integers(1, 100))]
               for _ in range(100)]
    params = [{"max_new_tokens": int(rng.integers(1, 20)), "temperature": float(rng.choice([0, 0.8])),
               "ignore_eos": True} for _ in prompts]
    before, before_engine = compile_count(), llama_engine.core.runner.compiles_after_warmup
    outs = llama_engine.generate(input_ids=prompts, sampling_params=params)
    assert [len(o["output_ids"]) for o in outs] == [p["max_new_tokens"] for p in params]
    assert compile_count() == before
    assert llama_engine.core.runner.compiles_after_warmup == before_engine


def test_seeded_sampling_independent_of_batch(llama_engine):
    set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    prompt = boundary_prompts(1, seed=4, lengths=(21,))[0]
    sp = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 1234,
          "ignore_eos": True}
    alone = llama_engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    busy_prompts = boundary_prompts(10, seed=6) + [prompt]
    busy_params = [{"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True}] * 10 + [sp]
    busy = llama_engine.generate(input_ids=busy_prompts, sampling_params=busy_params)[-1]["output_ids"]
    assert busy == alone
    other = llama_engine.generate(input_ids=prompt, sampling_params={**sp, "seed": 99})["output_ids"]
    assert other != alone
    # Sampling really samples: temperature 1 differs from greedy somewhere.
    greedy = llama_engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 10})
    assert greedy["output_ids"] != alone


def test_stop_conditions(llama_engine):
    set_sched(llama_engine)
    prompt = boundary_prompts(1, seed=7, lengths=(12,))[0]
    free = llama_engine.generate(input_ids=prompt, sampling_params=GREEDY)
    toks = free["output_ids"]
    # stop_token_ids: stops at the first occurrence of the third generated token.
    stop_at = toks[2]
    out = llama_engine.generate(input_ids=prompt, sampling_params={**GREEDY, "stop_token_ids": [stop_at]})
    k = toks.index(stop_at)
    assert out["output_ids"] == toks[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    # EOS counts unless ignore_eos.
    eos = next(iter(llama_engine.core.eos_token_ids))
    out = llama_engine.generate(input_ids=prompt, sampling_params={**GREEDY, "ignore_eos": False,
                                "stop_token_ids": []})
    assert eos not in out["output_ids"][:-1]
    # Context length: generation stops at the engine's context length (max_new_tokens None:
    # up to it; an explicit 50 would not fit after the prompt, a ValueError).
    long = boundary_prompts(1, seed=8, lengths=(120,))[0]
    out = llama_engine.generate(input_ids=long, sampling_params={**GREEDY, "max_new_tokens": None})
    assert len(long) + len(out["output_ids"]) == llama_engine.core.context_length
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_a_refused_prompt_of_a_batch_leaves_nothing_queued(llama_engine):
    """A text that gives no tokens is named as a prompt (not as input_ids); any refused prompt
    of a batch takes the batch's earlier requests, already queued, out again."""
    core = llama_engine.core
    vocab = core.model_cfg.vocab_size
    with pytest.raises(ValueError, match=r"^prompt: the text '' gives no tokens"):
        llama_engine.generate("", {"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"^prompt\[1\]: the text '' gives no tokens"):
        llama_engine.generate(["Hello", ""], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match=rf"^input_ids\[2\]\[1\]: token id {vocab} is outside"):
        llama_engine.generate(input_ids=[[5, 6, 7], [8, 9], [5, vocab]],
                              sampling_params={"max_new_tokens": 2, "n": 2})
    assert not core.scheduler.has_work and not core.scheduler.requests
    assert core.scheduler.num_used_pages == core.scheduler.prefix_cache.num_cached_pages
    out = llama_engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY,
                                                                     "max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def test_one_request_failing_to_sample_fails_alone(llama_engine):
    """A request whose sampling raises (here a seed numpy refuses, set past validation) gets
    an error; the requests sharing its batch finish normally and its pages come back."""
    from pdjax.engine_io import GenerateRequest
    from pdjax.request import SamplingParams

    sched = set_sched(llama_engine, chunked_prefill_size=64)
    core = llama_engine.core
    prompts = boundary_prompts(3, seed=12, lengths=(5, 9, 17))
    sp = SamplingParams(max_new_tokens=5, temperature=0.7, ignore_eos=True)
    reqs = [core.add_request(GenerateRequest(f"r{i}", p, sp)) for i, p in enumerate(prompts)]
    reqs[1].seed_for_sampling = -5
    outs = {}
    while sched.has_work:
        for out in core.step():
            outs.setdefault(out.rid, []).append(out)
        sched.check_invariants()
    assert outs["r1"][-1].finished and "sampling failed" in outs["r1"][-1].error
    for rid in ("r0", "r2"):
        assert outs[rid][-1].error is None
        assert sum(len(o.new_token_ids) for o in outs[rid]) == 5
    assert not sched.running and sched.num_used_pages == sched.prefix_cache.num_cached_pages


def test_max_new_tokens_zero_returns_no_tokens(llama_engine):
    sched = set_sched(llama_engine)
    outs = llama_engine.generate(input_ids=boundary_prompts(2, seed=13, lengths=(7, 20)),
                                 sampling_params={"max_new_tokens": 0})
    for o in outs:
        assert o["output_ids"] == [] and o["text"] == ""
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert not sched.has_work and sched.num_used_pages == 0


def _shared_prefix_prompts(seed=21, prefix_len=37, tails=(3, 11, 1, 20, 6)):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(5, TINY_TOKENIZER_VOCAB, prefix_len).tolist()
    return [prefix + rng.integers(5, TINY_TOKENIZER_VOCAB, t).tolist() for t in tails]


def test_a_batch_sharing_a_prefix_computes_it_once_with_the_same_tokens(llama_engine):
    """In-batch prefix sharing: prompts of one batch with a common 37-token prefix compute it
    once (the later ones start at its last full page, in the same forward) and give the
    tokens and logprobs of a run without the prefix cache; with overlap on too."""
    prompts = _shared_prefix_prompts()
    set_sched(llama_engine, chunked_prefill_size=64, disable_radix_cache=True)
    ref = _run(llama_engine, prompts)
    assert [o["meta_info"]["cached_tokens"] for o in ref] == [0] * 5
    core = llama_engine.core
    for overlap in (False, True):
        before = core.overlap
        core.overlap = overlap
        try:
            sched = set_sched(llama_engine, chunked_prefill_size=64)
            sched.prefix_cache.reset()
            computed0 = sched.num_prompt_tokens_computed
            outs = _run(llama_engine, prompts, check=True)
        finally:
            core.overlap = before
        _assert_same(ref, outs, f"shared prefix, overlap {overlap}")
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert cached == [0, 32, 32, 32, 32], cached        # 4 full pages of 8 before position 37
        assert sched.num_prompt_tokens_computed - computed0 == \
            sum(len(p) for p in prompts) - sum(cached)
        assert not sched.running and sched.num_used_pages == sched.prefix_cache.num_cached_pages


def test_a_failed_step_leaves_no_unwritten_page_in_the_prefix_cache(llama_engine, monkeypatch):
    """The forward of a step raises before it is launched: the pages its rows shared when
    scheduled were never written, so they leave the prefix cache with the aborted requests;
    the next run computes (and answers) the prompts afresh."""
    prompts = _shared_prefix_prompts(seed=22)
    sched = set_sched(llama_engine, chunked_prefill_size=64)
    sched.prefix_cache.reset()
    ref = _run(llama_engine, prompts)
    sched.prefix_cache.reset()
    runner = llama_engine.core.runner
    real = runner.forward

    def failing(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner, "forward", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        _run(llama_engine, prompts)
    monkeypatch.setattr(runner, "forward", real)
    assert not sched.running and not sched.waiting and not sched.requests
    assert sched.prefix_cache.num_cached_pages == 0 and sched.num_used_pages == 0
    sched.check_invariants()
    again = _run(llama_engine, prompts, check=True)
    _assert_same(ref, again, "after a failed step")
    assert [o["meta_info"]["cached_tokens"] for o in again] == [0, 32, 32, 32, 32]


def test_unrolled_layers_give_the_same_tokens_and_no_compile_after_warmup(llama_engine,
                                                                          tiny_checkpoints):
    """``unroll_layers`` and ``cpu_matmul_kernel`` auto unroll the layers and pack their
    linear weights on CPU (the package's engine: one packed array per layer, the native
    matmul); both False scan the stacked layers through XLA's dots: the same tokens and
    logprobs through chunks, mixed steps and decode, and every shape of the scanned engine
    compiled at warm-up."""
    import jax

    from pdjax.engine import Engine

    def layer_weight(eng, name):
        return eng.core.runner.state["layers"][name].get_value()

    on_cpu = jax.default_backend() == "cpu"
    config = llama_engine.core.config
    assert config.unroll_layers is on_cpu and config.cpu_matmul_kernel is on_cpu
    unrolled = layer_weight(llama_engine, "wqkv" if on_cpu else "wq")
    assert isinstance(unrolled, tuple) is on_cpu
    if on_cpu:
        assert len(unrolled) == llama_engine.core.model_cfg.num_layers
        assert "wq" not in llama_engine.core.runner.state["layers"]
    prompts = boundary_prompts(12, seed=4)
    set_sched(llama_engine, chunked_prefill_size=16, enable_mixed_chunk=True,
              disable_radix_cache=True)
    ref = _run(llama_engine, prompts)
    eng = Engine(tiny_checkpoints["llama"], dtype="float32", page_size=8, max_total_tokens=4096,
                 max_running_requests=16, chunked_prefill_size=16, context_length=128,
                 enable_mixed_chunk=True, disable_radix_cache=True, unroll_layers=False,
                 cpu_matmul_kernel=False, progress=False)
    try:
        runner = eng.core.runner
        wq = layer_weight(eng, "wq")
        assert not isinstance(wq, tuple) and wq.shape[0] == eng.core.model_cfg.num_layers
        before = compile_count()
        modes = []
        outs = _run(eng, prompts, modes=modes, check=True)
        _assert_same(ref, outs, "scanned")
        assert {"mixed", "decode"} <= set(modes)
        assert compile_count() == before and runner.compiles_after_warmup == 0
    finally:
        eng.shutdown()
