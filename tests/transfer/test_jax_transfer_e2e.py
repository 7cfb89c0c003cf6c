"""PD with ``--disaggregation-transfer-backend jax`` (``jax.experimental.transfer`` pulls) end
to end: a prefill, a decode and the pdjax router, real processes on 127.0.0.1 at TP 1, checked
against the colocated engine's greedy tokens (tie-aware); the pools back at baseline after."""

import concurrent.futures
import random
import sys

import pytest
from pd_harness import (CHUNK, PAGE_SIZE, TINY_ARGS, Server, at_baseline, child_env, free_port,
                        get, greedy_agrees, load, metric_value, pd_router, pd_server, pd_state,
                        post, prefill_decode_router, running, wait_until)

pytestmark = pytest.mark.slow

JAX = ["--disaggregation-transfer-backend", "jax"]


def _reference(engine, prompts, max_new):
    outs = engine.generate(input_ids=prompts, return_logprob=True, top_logprobs_num=2,
                           sampling_params=[{"temperature": 0, "max_new_tokens": m}
                                            for m in max_new])
    return [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in outs]


def _generate(url, ids, max_new):
    status, out = post(url + "/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new}})
    assert status == 200, out
    return out


def _pd_matches_colocated(model, logs, vocab, lengths, **overrides):
    from pdjax.engine import Engine

    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    max_new = [3 + (i * 5) % 9 for i in range(len(prompts))]
    colocated = Engine(model_path=model, progress=False, **dict(TINY_ARGS, **overrides))
    try:
        ref = _reference(colocated, prompts, max_new)
    finally:
        colocated.shutdown()
    with prefill_decode_router(model, logs, prefill_extra=JAX, decode_extra=JAX,
                               **overrides) as pd:
        prefill, decode, router = pd["prefill"], pd["decode"], pd["router"]
        for s in (prefill, decode):
            st = pd_state(s)
            assert st["transfer_backend"] == "jax" and st["transfer_path"] == "jax", st
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda a: _generate(router.url, *a), zip(prompts, max_new)))
        compared = sum(greedy_agrees(ids, top, res["output_ids"])
                       for (ids, top), res in zip(ref, results))
        assert compared >= 0.8 * sum(max_new), compared
        assert wait_until(lambda: at_baseline(prefill) and at_baseline(decode), 20)
        state = pd_state(prefill)
        bpp = state["kv_bytes_per_page"]
        pages = sum(r["pages"] for r in state["recent"])
        page_size = overrides.get("page_size", PAGE_SIZE)
        assert pages == sum(-(-n // page_size) for n in lengths)
        p_metrics = get(prefill.url + "/metrics")[1]
        assert metric_value(p_metrics, "pdjax:kv_transfer_total_bytes_total",
                            role="prefill") == pages * bpp
        assert state["engine"]["bytes"] == pages * bpp and state["engine"]["failures"] == 0
        d_metrics = get(decode.url + "/metrics")[1]
        assert "pdjax:kv_transfer_failed_total{" not in d_metrics + p_metrics
        assert load(decode)["num_prompt_tokens_computed"] == 0
        return state


def test_gqa_llama_pd_over_jax_transfer_matches_colocated(tiny_checkpoints, tmp_path):
    """Prompts of 1 page, a page +- 1 token, and several chunks (one offer per chunk, buckets
    1..16 pages) give the colocated engine's greedy tokens through the jax data plane."""
    lengths = [3, PAGE_SIZE + 1, 2 * PAGE_SIZE - 1, CHUNK + 1, 2 * CHUNK + 7, 70]
    state = _pd_matches_colocated(tiny_checkpoints["llama"], str(tmp_path), 440, lengths)
    # Several chunks per long prompt, each one offer (copies = arrays pulled: K and V).
    long = [r for r in state["recent"] if r["prompt_len"] == 70][0]
    assert len(long["chunks"]) >= 3
    assert all(r["copies"] == 2 * len(r["chunks"]) for r in state["recent"])


def test_deepseek_v32_mla_and_indexer_caches_over_jax_transfer(tiny_checkpoints, tmp_path):
    """The tiny DeepSeek-V3.2 (MLA latent + DSA indexer key caches, prompts past its
    index_topk so the sparse selection reads moved indexer keys) gives colocated's tokens."""
    import json
    import os

    model = tiny_checkpoints["deepseek_v32_long"]
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    lengths = [9, 17, 33, 41]
    assert max(lengths) > cfg["index_topk"]
    state = _pd_matches_colocated(model, str(tmp_path), 440, lengths,
                                  page_size=8, max_total_tokens=512, chunked_prefill_size=16,
                                  max_running_requests=2, context_length=64)
    names = [b for b in state["kv_shard_heads"]]
    assert len(names) == 2        # latent and indexer keys, one "head" each
    assert all(r["copies"] == 2 * len(r["chunks"]) for r in state["recent"])


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_different_tp_sizes_over_jax_transfer_match_colocated(tiny_checkpoints, tmp_path,
                                                              tp_p, tp_d):
    """A TP ``tp_p`` prefill feeds a TP ``tp_d`` decode (tiny Llama, 2 KV heads, simulated
    CPU devices): K and V move as 2 head-group units a chunk; colocated's greedy tokens
    through pdjax's router and through sglang-router."""
    _tp_pair(tiny_checkpoints["llama"], str(tmp_path), tp_p, tp_d)


@pytest.mark.parametrize("tp_p,tp_d", [(3, 1), (1, 3)])
def test_smollm2_tp3_and_tp1_over_jax_transfer_match_colocated(tmp_path, tp_p, tp_d):
    """SmolLM2-135M (3 KV heads): a TP 3 prefill feeds a TP 1 decode and the reverse."""
    from pdjax.models.checkpoint import default_model_path

    _tp_pair(default_model_path(), str(tmp_path), tp_p, tp_d)


@pytest.mark.parametrize("tp_p,tp_d", [(4, 1), (1, 4)])
def test_tp_above_the_kv_heads_over_jax_transfer_matches_colocated(tiny_checkpoints, tmp_path,
                                                                   tp_p, tp_d):
    """The tiny Llama's 2 KV heads at TP 4 (``tp_model_config`` holds each twice, one copy a
    device) against TP 1: each checkpoint head moves once (2 units of K and of V a chunk);
    a TP 4 decode copies it to both devices holding it. Colocated's greedy tokens."""
    _tp_pair(tiny_checkpoints["llama"], str(tmp_path), tp_p, tp_d, arrays_per_chunk=4)


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_deepseek_v32_replicated_caches_between_tp_sizes(tiny_checkpoints, tmp_path, tp_p,
                                                         tp_d):
    """The MLA latent and DSA indexer caches are replicated on every device: each chunk moves
    them once (2 arrays), and a TP 2 decode copies them to its second device."""
    _tp_pair(tiny_checkpoints["deepseek_v32_long"], str(tmp_path), tp_p, tp_d,
             arrays_per_chunk=2, lengths=(9, 33, 41), page_size=8, max_total_tokens=512,
             chunked_prefill_size=16, max_running_requests=2, context_length=64)


def _tp_pair(model, logs, tp_p, tp_d, arrays_per_chunk=None, lengths=(5, CHUNK + 3, 70),
             **overrides):
    """``model`` at TP ``tp_p`` -> ``tp_d`` over the jax backend, through both routers,
    against the colocated engine; ``arrays_per_chunk``: the arrays a chunk moves (default:
    K and V in ``max(tp_p, tp_d)`` units each)."""
    from pdjax.engine import Engine

    rng = random.Random(9)
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in lengths]
    max_new = [6, 5, 7][:len(prompts)]
    args = dict(TINY_ARGS, **overrides)
    colocated = Engine(model_path=model, progress=False, **args)
    try:
        ref = _reference(colocated, prompts, max_new)
    finally:
        colocated.shutdown()
    devices = max(tp_p, tp_d)
    env = child_env(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false "
                              f"--xla_force_host_platform_device_count={devices}")
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, extra=JAX,
                        env=env, tp_size=tp_p, **overrides)
    decode = pd_server("decode", "decode", model, logs, extra=JAX, env=env, tp_size=tp_d,
                       **overrides)
    router = pd_router("router", prefill, bport, decode, logs)
    port = free_port()
    sglang = Server("sglang-router", [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", prefill.url, str(bport), "--decode", decode.url, "--host", "127.0.0.1",
        "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn"],
        port, logs, child_env())
    with running([prefill, decode, router, sglang]):
        # sglang-router answers /health before its health checks found the workers.
        probe = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
        assert wait_until(lambda: post(sglang.url + "/generate", probe)[0] == 200, 120, 1.0)
        for url in (router.url, sglang.url):          # pdjax's router, then sglang-router
            results = [_generate(url, p, m) for p, m in zip(prompts, max_new)]
            compared = sum(greedy_agrees(ids, top, res["output_ids"])
                           for (ids, top), res in zip(ref, results))
            assert compared >= 0.8 * sum(max_new), (url, compared)
        assert wait_until(lambda: at_baseline(prefill) and at_baseline(decode), 20)
        state = pd_state(prefill)
        assert len([r for r in state["recent"] if r["pages"]]) == 2 * len(prompts) + 1
        assert [len(h) for h in state["kv_shard_heads"]] == [tp_p, tp_p]
        assert [len(h) for h in pd_state(decode)["kv_shard_heads"]] == [tp_d, tp_d]
        # K and V, max(tp_p, tp_d) head-group units each, per chunk; bytes are what the
        # decode's shards hold.
        per_chunk = 2 * devices if arrays_per_chunk is None else arrays_per_chunk
        assert all(r["copies"] == per_chunk * len(r["chunks"]) for r in state["recent"])
        pages = sum(r["pages"] for r in state["recent"])
        assert state["engine"]["bytes"] == pages * pd_state(decode)["kv_bytes_per_page"]
        assert load(decode)["num_prompt_tokens_computed"] == 0


def test_mtp_hidden_states_travel_over_jax_transfer(tiny_checkpoints, tmp_path):
    """The MTP hidden-state buffer moves with the KV (the repeater checkpoint of
    ``test_pd_mtp``): the decode's first drafts read the prefill's last hidden state, so every
    draft is accepted (acceptance rate exactly 1) only when it arrived."""
    from mtp_checkpoint import write_repeater_checkpoint

    k = 4
    spec = ["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", str(k),
            "--speculative-disable-adaptive"]
    model = write_repeater_checkpoint(tiny_checkpoints["glm_moe_dsa"],
                                      str(tmp_path / "repeater"))
    with prefill_decode_router(model, str(tmp_path), prefill_extra=spec + JAX,
                               decode_extra=spec + JAX, page_size=8, max_total_tokens=512,
                               chunked_prefill_size=16, max_running_requests=2,
                               context_length=64) as pd:
        greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1 + 3 * k}
        verified = 0
        for ids in [[(11 * i + 5 * n) % 440 + 3 for i in range(n)] for n in (9, 17, 30)]:
            out = _generate_sp(pd["router"].url, ids, greedy)
            assert out["output_ids"] == [ids[-1]] * greedy["max_new_tokens"]
            verified += out["meta_info"].get("spec_verify_ct", 0)
        assert verified >= 6
        text = get(pd["decode"].url + "/metrics")[1]
        assert metric_value(text, "pdjax:spec_accept_rate") == 1.0
        assert pd_state(pd["prefill"])["transfer_backend"] == "jax"
        assert wait_until(lambda: at_baseline(pd["decode"]) and at_baseline(pd["prefill"]), 30)


def _generate_sp(url, ids, sampling_params):
    status, out = post(url + "/generate", {"input_ids": ids, "sampling_params": sampling_params})
    assert status == 200, out
    return out


def test_a_decode_prefix_hit_shrinks_the_jax_transfer(tiny_checkpoints, tmp_path):
    """A prompt sharing 40 tokens (10 pages) with one the decode served: only its last 3
    pages are offered, scattered after the decode's cached ones; colocated's tokens. With a
    shared secret (the offers are sealed)."""
    from pdjax.engine import Engine

    model = tiny_checkpoints["llama"]
    rng = random.Random(3)
    first = [rng.randrange(3, 440) for _ in range(41)]
    second = first[:40] + [rng.randrange(3, 440) for _ in range(9)]
    colocated = Engine(model_path=model, progress=False, **TINY_ARGS)
    try:
        (ids, top), = _reference(colocated, [second], [8])
    finally:
        colocated.shutdown()
    secret = ["--disaggregation-secret", "s3cret"]       # offers sealed too
    with prefill_decode_router(model, str(tmp_path), prefill_extra=JAX + secret,
                               decode_extra=JAX + secret) as pd:
        _generate(pd["router"].url, first, 4)
        out = _generate(pd["router"].url, second, 8)
        assert greedy_agrees(ids, top, out["output_ids"]) >= 4
        assert wait_until(lambda: at_baseline(pd["prefill"]) and at_baseline(pd["decode"]), 20)
        (rec,) = [r for r in pd_state(pd["prefill"])["recent"] if r["prompt_len"] == 49]
        assert rec["decode_prefix_len"] == 40 and rec["pages"] == 13 - 10, rec
        assert out["meta_info"]["cached_tokens"] >= 40
