"""The MTP drafter (``--speculative-algorithm mtp``, DESIGN.md §3 "Speculative decoding") on the
tiny DeepSeek-V3.2 and GLM-5, whose MTP layer ``scripts/make_tiny_checkpoint.py`` adds:

- the MTP weights load as the safetensors hold them; the first position's MTP logits equal a
  numpy re-implementation written from the HF tensors (embedding first in the concat);
- greedy tokens equal those of the same engine decoding plainly (requests opting out),
  tie-aware (DESIGN.md §5), with prefill chunks and verify rows in one forward; every
  incremental proposal (rolled back after rejections) equals the proposal of a fresh request
  with the same ids; no compile after warm-up; every page of both pools comes back;
- with weights where the draft is known (the decoder layer zeroed out of the residual stream,
  ``eh_proj`` passing only the embedding or only the hidden state), the drafts are exactly
  the embedding bigram chain, or the target's own next token (which checks that draft 1 reads
  the target's hidden state of position ``L - 2``).
"""

import json
import os
import types

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from model_utils import (TINY_TOKENIZER_VOCAB, assert_tokens_match, set_sched,
                         top2_gaps_from_top_logprobs)
from pdjax.config import ServerArgs
from pdjax.engine import Engine
from pdjax.models.attention import AttentionMetadata
from pdjax.models.loader import load_model
from pdjax.runner.model_runner import compile_count
from pdjax.sched.batch import BatchRow, build_flat_batch

pytestmark = pytest.mark.slow      # slow tier: MTP drafting end to end on the tiny MLA models

NAMES = ["deepseek_v32", "glm_moe_dsa"]
K = 4                       # speculative_num_draft_tokens: the newest token + 3 drafts
GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}


def _hf_tensors(path):
    out = {}
    for name in ("model.safetensors", "model-mtp.safetensors"):
        out.update(load_file(os.path.join(path, name)))
    return out


# --------------------------------------------------------------------------- weights and math

@pytest.mark.parametrize("name", NAMES)
def test_mtp_weights_load_as_the_safetensors_hold_them(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    hf = _hf_tensors(path)
    cfg, model = load_model(path, dtype="float32", progress=False, mtp=True)
    n = cfg.num_layers
    pre = f"model.layers.{n}."
    m = model.mtp
    np.testing.assert_array_equal(np.asarray(m.eh_proj[...]), hf[pre + "eh_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.enorm[...]), hf[pre + "enorm.weight"])
    np.testing.assert_array_equal(np.asarray(m.hnorm[...]), hf[pre + "hnorm.weight"])
    np.testing.assert_array_equal(np.asarray(m.norm[...]), hf[pre + "shared_head.norm.weight"])
    np.testing.assert_array_equal(np.asarray(m.attn.w_qa[...][0]),
                                  hf[pre + "self_attn.q_a_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.attn.input_norm[...][0]),
                                  hf[pre + "input_layernorm.weight"])
    np.testing.assert_array_equal(np.asarray(m.moe.router[...][0]), hf[pre + "mlp.gate.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.indexer.wk[...][0]),
                                  hf[pre + "self_attn.indexer.wk.weight"].T)
    # The main layers are untouched, and a model without mtp=True has no MTP layer.
    np.testing.assert_array_equal(np.asarray(model.attn.w_qa[...][n - 1]),
                                  hf[f"model.layers.{n - 1}.self_attn.q_a_proj.weight"].T)
    assert cfg.num_nextn_predict_layers == 1
    _, plain = load_model(path, dtype="float32", progress=False)
    assert not hasattr(plain, "mtp")
    assert [s.name for s in plain.cache_spec(4, 8)] == ["latent", "indexer_k"]
    assert [s.name for s in model.cache_spec(4, 8)] == ["latent", "indexer_k", "mtp_hidden"]


def test_mtp_needs_a_checkpoint_with_an_mtp_layer(tiny_checkpoints):
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        load_model(tiny_checkpoints["deepseek_v32_long"], dtype="float32", progress=False,
                   mtp=True)
    # The config names an MTP layer (transformers' default) but the files hold none.
    with pytest.raises(ValueError, match="no tensor for parameter 'mtp[.]"):
        load_model(tiny_checkpoints["deepseek_v3"], dtype="float32", progress=False, mtp=True)
    # The Engine checks its checkpoint paths as serve does (check_checkpoint_paths).
    with pytest.raises(ValueError, match="speculative_algorithm: 'mtp' needs"):
        Engine(tiny_checkpoints["llama"], dtype="float32", progress=False,
               speculative_algorithm="mtp")
    with pytest.raises(ValueError, match="^speculative_algorithm: 'mtp' with nnodes > 1"):
        ServerArgs(model_path=tiny_checkpoints["glm_moe_dsa"], speculative_algorithm="mtp",
                   nnodes=2, dist_init_addr="127.0.0.1:5000")


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _numpy_mtp_first_position(cfg_json, hf, n, token, hidden):
    """Logits ``[V]`` of the MTP layer at position 0 (its attention sees one key, so softmax is
    1 and RoPE at position 0 is the identity) from the HF tensors, in float64."""
    t = {k: v.astype(np.float64) for k, v in hf.items()}
    eps = cfg_json["rms_norm_eps"]
    pre = f"model.layers.{n}."
    e = _rms(t["model.embed_tokens.weight"][token], t[pre + "enorm.weight"], eps)
    h = _rms(hidden.astype(np.float64), t[pre + "hnorm.weight"], eps)
    x = t[pre + "eh_proj.weight"] @ np.concatenate([e, h])          # embedding first
    a = _rms(x, t[pre + "input_layernorm.weight"], eps)
    sa = pre + "self_attn."
    C, H = cfg_json["kv_lora_rank"], cfg_json["num_attention_heads"]
    Nd, Vd = cfg_json["qk_nope_head_dim"], cfg_json["v_head_dim"]
    c = _rms((t[sa + "kv_a_proj_with_mqa.weight"] @ a)[:C], t[sa + "kv_a_layernorm.weight"], 1e-6)
    v = (t[sa + "kv_b_proj.weight"] @ c).reshape(H, Nd + Vd)[:, Nd:]
    x = x + t[sa + "o_proj.weight"] @ v.reshape(-1)
    g = _rms(x, t[pre + "post_attention_layernorm.weight"], eps)
    mlp = pre + "mlp."
    scores = 1 / (1 + np.exp(-(t[mlp + "gate.weight"] @ g)))
    choice = scores + t[mlp + "gate.e_score_correction_bias"]
    E, G = cfg_json["n_routed_experts"], cfg_json["n_group"]
    groups = np.sort(choice.reshape(G, E // G), -1)[:, -2:].sum(-1)
    keep = np.argsort(-groups, kind="stable")[:cfg_json["topk_group"]]
    masked = np.where(np.isin(np.arange(E) // (E // G), keep), choice, -np.inf)
    experts = np.argsort(-masked, kind="stable")[:cfg_json["num_experts_per_tok"]]
    w = scores[experts] / scores[experts].sum() * cfg_json["routed_scaling_factor"]
    F = cfg_json["moe_intermediate_size"]
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    y = np.zeros_like(x)
    for e_id, we in zip(experts, w):
        if mlp + "experts.gate_up_proj" in t:           # fused (transformers 5)
            gate, up = np.split(t[mlp + "experts.gate_up_proj"][e_id] @ g, [F])
            down = t[mlp + "experts.down_proj"][e_id]
        else:
            ex = f"{mlp}experts.{e_id}."
            gate, up = t[ex + "gate_proj.weight"] @ g, t[ex + "up_proj.weight"] @ g
            down = t[ex + "down_proj.weight"]
        y += we * (down @ (silu(gate) * up))
    sh = mlp + "shared_experts."
    y += t[sh + "down_proj.weight"] @ (silu(t[sh + "gate_proj.weight"] @ g)
                                       * (t[sh + "up_proj.weight"] @ g))
    out = _rms(x + y, t[pre + "shared_head.norm.weight"], eps)
    return t["lm_head.weight"] @ out


@pytest.mark.parametrize("name", NAMES)
def test_mtp_first_position_logits_equal_numpy(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    hf = _hf_tensors(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg_json = json.load(f)
    cfg, model = load_model(path, dtype="float32", progress=False, mtp=True)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    token = 17
    fb = build_flat_batch([BatchRow([token], 0, [1])], page_size=8, num_tokens_pad=1,
                          num_rows_pad=1, pages_per_seq_pad=1)
    md = AttentionMetadata(*(jnp.asarray(a) for a in (
        fb.positions, fb.slot_mapping, fb.cu_q_lens, fb.kv_lens, fb.page_indices,
        fb.distribution)))
    caches = {s.name: s.zeros() for s in model.mtp_cache_spec(2, 8)}
    out, caches = model.mtp_forward(jnp.asarray(fb.input_ids), jnp.asarray(hidden)[None],
                                    caches, md)
    ours = np.asarray(model.mtp_logits(out))[0]
    ref = _numpy_mtp_first_position(cfg_json, hf, cfg.num_layers, token, hidden)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # The MTP layer wrote its own latent at slot 8 (page 1), nothing else.
    latent = np.asarray(caches["latent"])
    assert np.abs(latent[0, 1, 0]).sum() > 0 and np.abs(latent[0, 1, 1:]).sum() == 0
    assert np.abs(latent[0, 0]).sum() == 0
    # Swapping the two halves of the concat gives other logits (the order is checked).
    h_first = model.mtp.eh_proj[...]
    Hd = cfg.hidden_size
    model.mtp.eh_proj[...] = jnp.concatenate([h_first[Hd:], h_first[:Hd]])
    swapped, _ = model.mtp_forward(jnp.asarray(fb.input_ids), jnp.asarray(hidden)[None],
                                   {s.name: s.zeros() for s in model.mtp_cache_spec(2, 8)}, md)
    assert not np.allclose(np.asarray(model.mtp_logits(swapped))[0], ref, rtol=1e-2)


# --------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module", params=NAMES)
def mtp_engine(request, tiny_checkpoints):
    eng = Engine(tiny_checkpoints[request.param], dtype="float32", page_size=8,
                 max_total_tokens=2048, max_running_requests=4, chunked_prefill_size=32,
                 context_length=128, progress=False, speculative_algorithm="mtp",
                 speculative_num_draft_tokens=K, speculative_disable_adaptive=True)
    eng.name = request.param
    yield eng
    eng.shutdown()


def _prompts(seed, lengths=(20, 37, 50)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY_TOKENIZER_VOCAB, n).tolist() for n in lengths]


def _record(drafter, log, check_fresh):
    """Wrap ``drafter.propose``: log ``(all_ids, drafts)`` of each request that drafted; with
    ``check_fresh`` also the proposal of a fresh request with the same ids and pages."""
    propose = drafter.propose

    def recording(requests, max_tokens):
        got = propose(requests, max_tokens)
        for req, k, drafts in zip(requests, max_tokens, got):
            if not drafts:
                continue
            fresh = None
            if check_fresh:
                twin = types.SimpleNamespace(rid="fresh", all_ids=list(req.all_ids),
                                             num_computed_tokens=req.num_computed_tokens,
                                             pages=list(req.pages))
                fresh = propose([twin], [k])[0]
                drafter.release("fresh")
            log.append((list(req.all_ids), list(drafts), fresh))
        return got

    drafter.propose = recording
    return lambda: vars(drafter).pop("propose")


def _drafts_logged(eng, prompts):
    """Generate ``prompts`` greedily; returns the ``_record`` log of the drafter's proposals."""
    log = []
    unwrap = _record(eng.core.speculator.drafter, log, check_fresh=False)
    try:
        eng.generate(input_ids=prompts, sampling_params=GREEDY)
    finally:
        unwrap()
    return log


def _pools_whole(eng):
    sched = eng.core.scheduler
    sched.check_invariants()
    assert eng.core.flush_cache() and sched.allocator.num_free == sched.config.num_pages - 1
    drafter = eng.core.speculator.drafter
    assert drafter._state == {}
    assert drafter.allocator.num_free == drafter.runner.num_pages - 1


def test_greedy_tokens_equal_with_mtp(mtp_engine):
    eng = mtp_engine
    base = eng.core.sched_config
    set_sched(eng, chunked_prefill_size=16, enable_mixed_chunk=True)
    prompts = _prompts(1, lengths=(12, 70, 90))
    before = compile_count()
    ref = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "speculative": False},
                       return_logprob=True, top_logprobs_num=2)
    drafter = eng.core.speculator.drafter
    log, mixed = [], []
    hook = lambda batch, outs: mixed.append(  # noqa: E731
        any(r.is_verify for r in batch.rows)
        and any(not r.is_verify and not r.is_decode for r in batch.rows))
    eng.core.step_hooks.append(hook)
    unwrap = _record(drafter, log, check_fresh=True)
    assert eng.core.flush_cache()           # no prefix hit: the prompts are prefilled anew
    try:
        out = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        # Prefix hits: the hidden states of the cached pages are those the first run wrote.
        again = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    finally:
        unwrap()
        eng.core.step_hooks.remove(hook)
        set_sched(eng, **{k: getattr(base, k) for k in ("chunked_prefill_size",
                                                           "enable_mixed_chunk")})
    for o, a, r in zip(out, again, ref):
        gaps = top2_gaps_from_top_logprobs(r["meta_info"]["output_top_logprobs"])
        assert_tokens_match(o["output_ids"], r["output_ids"], gaps, what=eng.name)
        assert_tokens_match(a["output_ids"], r["output_ids"], gaps, what=eng.name + " (hit)")
        assert len(o["output_ids"]) == len(a["output_ids"]) == GREEDY["max_new_tokens"]
        assert a["meta_info"]["cached_tokens"] > 0
    assert sum(mixed) >= 1, "no forward held both a prefill chunk and a verify row"
    assert all(o["meta_info"].get("spec_verify_ct", 0) >= 3 for o in out + again)
    assert len(log) >= 18 and sum(len(d) == K - 1 for _, d, _ in log) >= 18
    # Rolled back and caught up incrementally, the MTP KV drafts as a fresh request's does.
    assert all(d == fresh for _, d, fresh in log), [(d, f) for _, d, f in log if d != f]
    assert compile_count() == before, "the MTP layer compiled after warm-up"
    _pools_whole(eng)


def test_seeded_sampled_requests_draw_the_same_tokens(mtp_engine):
    """A seeded draw depends on the seed and the position only (DESIGN.md §3), so sampled
    requests give the same tokens with MTP drafts as without."""
    eng = mtp_engine
    sampled = [{"max_new_tokens": 16, "temperature": 0.8, "top_k": 50, "seed": 7 + i,
                "ignore_eos": True} for i in range(3)]
    prompts = _prompts(6, lengths=(12, 30, 19))
    rows0 = eng.core.speculator.stats.num_verify_rows
    spec = eng.generate(input_ids=prompts, sampling_params=sampled)
    plain = eng.generate(input_ids=prompts,
                         sampling_params=[{**p, "speculative": False} for p in sampled])
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert all(o["meta_info"].get("spec_verify_ct", 0) > 0 for o in spec)
    assert eng.core.speculator.stats.num_verify_rows > rows0
    _pools_whole(eng)


def _set(state, path, value):
    node = state
    for p in path[:-1]:
        node = node[p]
    old = node[path[-1]].get_value()
    node[path[-1]].set_value(jnp.asarray(value, old.dtype))
    return old


def test_drafts_with_weights_where_the_draft_is_known(mtp_engine):
    eng = mtp_engine
    runner = eng.core.runner
    state = runner.state
    Hd = eng.core.model_cfg.hidden_size
    mtp = ("mtp",)
    # The decoder layer adds nothing to the residual stream: the attention's and the MLP's
    # output projections are zero.
    zeroed = {mtp + ("attn", "w_o"): 0, mtp + ("moe", "w_down"): 0, mtp + ("moe", "sh_down"): 0}
    saved = {}

    def put(path, value):
        old = _set(state, path, value)
        saved.setdefault(path, old)
        return old

    embed = np.asarray(state["embed_tokens"].get_value(), np.float64)
    head = np.asarray(state["lm_head"].get_value(), np.float64)
    eps = eng.core.model_cfg.rms_norm_eps
    try:
        for path, v in zeroed.items():
            put(path, np.zeros(np.shape(state[path[0]][path[1]][path[2]].get_value())))
        eye = np.eye(Hd)
        # (a) eh_proj passes the embedding only: draft j+1 = B(draft j), B the bigram map.
        put(mtp + ("eh_proj",), np.concatenate([eye, 0 * eye]))
        enorm = np.asarray(state["mtp"]["enorm"].get_value(), np.float64)
        norm = np.asarray(state["mtp"]["norm"].get_value(), np.float64)
        bigram = np.argmax(_rms(_rms(embed, enorm, eps), norm, eps) @ head, -1)
        log = _drafts_logged(eng, _prompts(2, (15, 26)))
        assert len(log) >= 6
        for ids, drafts, _ in log:
            want = [int(bigram[ids[-1]])]
            while len(want) < len(drafts):
                want.append(int(bigram[want[-1]]))
            assert drafts == want, (ids[-3:], drafts, want)
        # (b) eh_proj passes the hidden state only (norms of ones): the MTP logits are the
        # target's logits at the position read, scaled, so draft 1 is the target's greedy
        # token after position L - 2, the newest token itself, and the chain repeats it.
        put(mtp + ("eh_proj",), np.concatenate([0 * eye, eye]))
        put(mtp + ("hnorm",), np.ones(Hd))
        put(mtp + ("norm",), np.ones(Hd))
        log = _drafts_logged(eng, _prompts(3, (15, 26)))
        assert len(log) >= 4
        assert all(drafts == [ids[-1]] * len(drafts) for ids, drafts, _ in log), log
    finally:
        for path, old in saved.items():
            _set(state, path, old)
    _pools_whole(eng)


@pytest.mark.parametrize("name,tp", [("deepseek_v32", 1), ("glm_moe_dsa", 1), ("glm_moe_dsa", 2)])
def test_every_draft_accepted_where_the_mtp_layer_predicts_the_target(tiny_checkpoints,
                                                                      tmp_path_factory, name, tp):
    """The repeater checkpoint (``tests/mtp_checkpoint.py``): the target repeats the last
    prompt token and the MTP layer predicts exactly that from the hidden state it reads, so
    every draft is accepted: each verify row emits ``K`` tokens. At TP 2 too (the MTP layer's
    weights sharded as the target's, its KV replicated)."""
    from mtp_checkpoint import write_repeater_checkpoint

    path = write_repeater_checkpoint(tiny_checkpoints[name],
                                     str(tmp_path_factory.mktemp("repeater") / name))
    eng = Engine(path, dtype="float32", page_size=8, max_total_tokens=2048, tp_size=tp,
                 max_running_requests=4, chunked_prefill_size=32, context_length=128,
                 progress=False, speculative_algorithm="mtp", speculative_num_draft_tokens=K,
                 speculative_disable_adaptive=True)
    try:
        prompts = _prompts(4, lengths=(9, 30, 45))
        sp = {**GREEDY, "max_new_tokens": 1 + 3 * K}
        plain = eng.generate(input_ids=prompts, sampling_params={**sp, "speculative": False})
        before = compile_count()
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        for p, o, r in zip(prompts, out, plain):
            assert o["output_ids"] == r["output_ids"] == [p[-1]] * sp["max_new_tokens"]
        stats = eng.core.speculator.stats
        assert stats.num_verify_rows >= 3 * len(prompts) - 1
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        assert compile_count() == before
        _pools_whole(eng)
    finally:
        eng.shutdown()
