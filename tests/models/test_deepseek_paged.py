"""The MLA family over the paged caches: decode == full forward, chunked prefill and mixed
batches give the same tokens, Pallas kernels inside the model, TP, cache layout, config errors.

Every forward here uses one bucket (64 tokens, 16 pages of 4) so each model compiles once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import lowering_context
from mla_utils import PAGE, kernel_names, new_caches, prompts, run_rows
from model_utils import assign_pages, greedy_match_len
from pdjax.models.cache_spec import bytes_per_page
from pdjax.models.deepseek import DeepseekForCausalLM, deepseek_cache_spec
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.loader import load_model, make_mesh
from pdjax.pallas_kernels.lanes import kv_row_align
from pdjax.sched.batch import BatchRow

BUCKET = dict(tokens=64, pages=16)


def _full(model, prompt, seed=0):
    pages = assign_pages([len(prompt)], PAGE, 96, seed)[0]
    logits, _ = run_rows(model, [BatchRow(prompt, 0, pages, logits_start=0)], new_caches(model),
                         **BUCKET)
    return logits[0]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32_long", "glm_moe_dsa_long"])
def test_paged_decode_matches_full_forward(tiny_checkpoints, name):
    """Prefill 20 tokens, then decode the other 24 one by one beside another request: each
    step's logits equal the one-shot forward's row (shuffled page tables, 1e-4)."""
    _, model = load_model(tiny_checkpoints[name], dtype="float32", progress=False)
    prompt, other = prompts(3, (44, 9))
    full = _full(model, prompt)
    caches = new_caches(model)
    pages, other_pages = assign_pages([len(prompt), len(other) + 30], PAGE, 96, seed=5)
    got, caches = run_rows(model, [BatchRow(other, 0, other_pages),
                                   BatchRow(prompt[:20], 0, pages, logits_start=0)],
                           caches, **BUCKET)
    rows = [got[1]]
    for pos in range(20, len(prompt)):
        step = [BatchRow([other[pos % 9]], len(other) + pos - 20, other_pages),
                BatchRow([prompt[pos]], pos, pages)]
        got, caches = run_rows(model, step, caches, **BUCKET)
        rows.append(got[1])
    rows = np.concatenate(rows)
    assert rows.shape == full.shape
    err = np.abs(rows - full).max()
    assert err < 1e-4, (name, err)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa_long"])
def test_chunked_prefill_in_mixed_batches_gives_same_tokens(tiny_checkpoints, name):
    """Greedy generation after a one-shot prefill vs after 8-token chunks that share each
    forward with a running decode request (decode rows first, DESIGN.md §2)."""
    _, model = load_model(tiny_checkpoints[name], dtype="float32", progress=False)
    prompt, other = prompts(7, (42, 6))
    new_tokens = 6

    def generate(chunk):
        caches = new_caches(model)
        pages, other_pages = assign_pages([len(prompt) + new_tokens, 64], PAGE, 96, seed=chunk)
        # The other request is prefilled, then decodes alongside every chunk.
        got, caches = run_rows(model, [BatchRow(other, 0, other_pages)], caches, **BUCKET)
        o_len, o_next = len(other), int(got[0][-1].argmax())
        logits = []
        for start in range(0, len(prompt), chunk):
            rows = [BatchRow([o_next], o_len, other_pages),
                    BatchRow(prompt[start:start + chunk], start, pages)]
            got, caches = run_rows(model, rows, caches, chunk_size=chunk, **BUCKET)
            o_len, o_next = o_len + 1, int(got[0][-1].argmax())
        logits.append(got[1][-1])
        tokens = [int(got[1][-1].argmax())]
        for i in range(new_tokens - 1):
            rows = [BatchRow([o_next], o_len, other_pages),
                    BatchRow([tokens[-1]], len(prompt) + i, pages)]
            got, caches = run_rows(model, rows, caches, **BUCKET)
            o_len, o_next = o_len + 1, int(got[0][-1].argmax())
            logits.append(got[1][-1])
            tokens.append(int(got[1][-1].argmax()))
        return tokens, np.stack(logits)

    ref_tokens, ref_logits = generate(len(prompt))
    tokens, logits = generate(8)
    n = greedy_match_len(ref_logits, ref_tokens)
    assert tokens[:n + 1] == ref_tokens[:n + 1] and n >= 3, (tokens, ref_tokens, n)
    assert np.abs(logits[:n + 1] - ref_logits[:n + 1]).max() < 1e-4


# One case per model kind keeps interpret-mode compiles short; the kernel tests cover the rest.
@pytest.mark.parametrize("name,impl", [("deepseek_v3", "tpu"), ("glm_moe_dsa_long", "gpu")])
def test_pallas_kernels_inside_the_model(tiny_checkpoints, name, impl):
    """The model with the interpreted Pallas kernels (dense MLA attention for V3; the indexer
    and sparse MLA attention for GLM-5) equals the reference path on a mixed batch whose
    prompt is longer than index_topk. The TPU kernels read the TPU layout: rows padded to
    whole lanes (``lanes.kv_row_align("tpu")``)."""
    path = tiny_checkpoints[name]
    _, ref_model = load_model(path, dtype="float32", progress=False)
    _, model = load_model(path, dtype="float32", progress=False, attention_impl=impl,
                          pallas_interpret=True)
    prompt, other = prompts(11, (20, 3))
    pages, other_pages = assign_pages([len(prompt), len(other) + 1], PAGE, 96, seed=2)
    out = []
    for m, align in ((ref_model, 1), (model, kv_row_align(impl))):
        caches = new_caches(m, row_align=align)
        _, caches = run_rows(m, [BatchRow(other, 0, other_pages)], caches, tokens=24, pages=6)
        got, _ = run_rows(m, [BatchRow([9], len(other), other_pages),
                              BatchRow(prompt, 0, pages, logits_start=0)], caches,
                          tokens=24, pages=6)
        out.append(np.concatenate(got))
    assert np.abs(out[0] - out[1]).max() < 1e-4
    names = kernel_names(model, [BatchRow(prompt, 0, pages)], new_caches(model), tokens=24,
                         pages=6)
    mode = "dense" if name == "deepseek_v3" else "sparse"
    want = {f"mla_{mode}_attention_{impl}"} | ({f"indexer_scores_{impl}"} if mode == "sparse"
                                               else set())
    assert names == want


@pytest.mark.parametrize("platform,impl,marker", [("tpu", "tpu", "tpu_custom_call"),
                                                   ("cuda", "gpu", "__gpu$xla.gpu.triton")])
def test_model_with_kernels_lowers_for_accelerators(tiny_checkpoints, platform, impl, marker):
    """The whole GLM-5 forward with the kernels forced lowers for TPU and CUDA on CPU."""
    from pdjax.models.attention import AttentionMetadata

    _, model = load_model(tiny_checkpoints["glm_moe_dsa_long"], dtype="float32", progress=False,
                          attention_impl=impl)
    md = AttentionMetadata(
        positions=jnp.arange(16, dtype=jnp.int32),
        slot_mapping=jnp.arange(16, dtype=jnp.int32) + PAGE,
        cu_q_lens=jnp.array([0, 16, 16, 16, 16], jnp.int32),
        kv_lens=jnp.array([16, 0, 0, 0], jnp.int32),
        page_indices=jnp.tile(jnp.arange(1, 9, dtype=jnp.int32), (4, 1)),
        distribution=jnp.array([0, 0, 1], jnp.int32))
    f = jax.jit(lambda m, ids, c, md: m(ids, c, md, jnp.zeros(4, jnp.int32)))
    with lowering_context(platform):
        text = f.trace(model, jnp.zeros(16, jnp.int32), new_caches(model), md).lower(
            lowering_platforms=(platform,)).as_text()
    # Two scans (dense layer 0, MoE layers 1-2), each body one MLA kernel and one indexer
    # kernel (inside the full/shared cond); the MoE body also the experts' three grouped GEMMs.
    assert text.count(marker) == 4 + 3


def test_lane_padded_caches_give_the_same_logits(tiny_checkpoints):
    """Latent and indexer rows padded with zero lanes to 128 (the TPU layout) give the logits
    of the compact rows, through a prefill and decode steps (the pad is written as zeros and
    the queries are padded to match)."""
    _, model = load_model(tiny_checkpoints["glm_moe_dsa_long"], dtype="float32", progress=False)
    prompt = prompts(6, (30,))[0]
    pages = assign_pages([len(prompt)], PAGE, 96, seed=4)[0]
    out = []
    for align in (1, 128):
        caches = new_caches(model, row_align=align)
        assert caches["latent"].shape[-1] == (48 if align == 1 else 128)
        assert caches["indexer_k"].shape[-1] == (32 if align == 1 else 128)
        got, caches = run_rows(model, [BatchRow(prompt[:24], 0, pages, logits_start=0)],
                               caches, **BUCKET)
        rows = [got[0]]
        for pos in range(24, len(prompt)):
            got, caches = run_rows(model, [BatchRow([prompt[pos]], pos, pages)], caches,
                                   **BUCKET)
            rows.append(got[0])
        assert not np.asarray(caches["latent"])[..., 48:].any()      # the pad stays zero
        out.append(np.concatenate(rows))
    assert out[0].shape == (30, model.cfg.vocab_size)
    assert np.abs(out[0] - out[1]).max() < 1e-5


def test_tensor_parallel_matches_single_device(tiny_checkpoints):
    path = tiny_checkpoints["glm_moe_dsa_long"]
    _, model1 = load_model(path, dtype="float32", progress=False)
    _, model2 = load_model(path, dtype="float32", progress=False, mesh=make_mesh(2))
    assert len(model2.attn.w_qb[...].sharding.device_set) == 2
    p = prompts(4, (33,))[0]
    a, b = _full(model1, p), _full(model2, p)
    assert np.abs(a - b).max() < 1e-4


def test_cache_spec_bytes_per_page(tiny_checkpoints):
    cfg, model = load_model(tiny_checkpoints["glm_moe_dsa_long"], dtype="float32", progress=False)
    specs = model.cache_spec(num_pages=10, page_size=PAGE)
    assert [s.name for s in specs] == ["latent", "indexer_k"]
    latent, idx = specs
    assert latent.shape == (3, 10, PAGE, 48) and idx.shape == (2, 10, PAGE, 32)
    assert latent.bytes_per_page_layer == PAGE * 48 * 4
    assert latent.bytes_per_page == 3 * PAGE * 48 * 4
    assert idx.bytes_per_page == 2 * PAGE * 32 * 4          # only the "full" indexer layers
    assert bytes_per_page(specs) == 3 * 768 + 2 * 512
    v3 = DeepseekConfig.from_hf_dir(tiny_checkpoints["deepseek_v3"])
    bf16 = deepseek_cache_spec(v3, num_pages=10, page_size=16, dtype=jnp.bfloat16)
    assert [s.name for s in bf16] == ["latent"] and bf16[0].bytes_per_page == 3 * 16 * 48 * 2
    tpu = deepseek_cache_spec(v3, num_pages=10, page_size=16, dtype=jnp.bfloat16, row_align=128)
    assert tpu[0].shape == (3, 10, 16, 128)        # 48 lanes padded to one whole lane tile
    with pytest.raises(ValueError, match="caches is missing"):
        model(jnp.zeros(16, jnp.int32), {"latent": latent.zeros()}, None, jnp.zeros(1, jnp.int32))


def _hf_dict(**over):
    base = dict(architectures=["GlmMoeDsaForCausalLM"], vocab_size=64, hidden_size=32,
                intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                n_group=2, topk_group=1, first_k_dense_replace=1, index_topk=8,
                index_head_dim=16, index_n_heads=4)
    base.update(over)
    return base


@pytest.mark.parametrize("over,field", [
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(indexer_types=["shared", "full"]), "indexer_types"),
    (dict(n_group=3), "n_group"),
    (dict(index_head_dim=4), "index_head_dim"),
    (dict(num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type"),
    (dict(architectures=["LlamaForCausalLM"]), "architecture"),
])
def test_bad_configs_raise_value_error_naming_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        DeepseekConfig.from_hf_dict(_hf_dict(**over))


def test_glm_indexer_schedule_from_freq_and_offset():
    cfg = DeepseekConfig.from_hf_dict(_hf_dict(num_hidden_layers=6, index_topk_freq=2,
                                               index_skip_topk_offset=2))
    assert cfg.indexer_types == ("full", "full", "shared", "full", "shared", "full")
    cfg = DeepseekConfig.from_hf_dict(_hf_dict(index_topk_pattern="FS"))
    assert cfg.indexer_types == ("full", "shared") and cfg.full_indexer_layers == (0,)


def test_model_from_synthetic_weights_runs_and_rejects_bad_tp():
    """``loader.build_model`` places any parameter set of the right shapes (the route of a
    synthetic-weight check); missing or mis-shaped parameters and bad TP sizes are named."""
    import dataclasses

    from flax import nnx
    from pdjax.models.deepseek_weights import check_tp
    from pdjax.models.loader import build_model
    from pdjax.models.registry import model_family

    def build_deepseek_model(cfg, params, mesh, dtype):
        return build_model(model_family(cfg.architecture), cfg, params, mesh, dtype)[1]

    cfg = DeepseekConfig.from_hf_dict(_hf_dict())
    abstract = nnx.eval_shape(lambda: DeepseekForCausalLM(cfg, rngs=nnx.Rngs(0)))
    shapes = {".".join(map(str, k)): v.get_value().shape
              for k, v in nnx.to_flat_state(nnx.state(abstract))}
    assert shapes["moe.w_gate"] == (1, 4, 32, 16) and shapes["indexer.wq_b"] == (2, 16, 64)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(v).astype(np.float32) * 0.2 for k, v in shapes.items()}
    model = build_deepseek_model(cfg, params, make_mesh(1), jnp.float32)
    assert model.moe.router[...].dtype == jnp.float32
    logits, _ = run_rows(model, [BatchRow([1, 2, 3, 4, 5], 0, [1, 2])], new_caches(model))
    assert logits[0].shape == (1, 64) and np.isfinite(logits[0]).all()
    bad = dict(params, **{"attn.w_o": params["attn.w_o"][:, :3]})
    with pytest.raises(ValueError, match="attn.w_o"):
        build_deepseek_model(cfg, bad, make_mesh(1), jnp.float32)
    with pytest.raises(ValueError, match="norm"):
        build_deepseek_model(cfg, {k: v for k, v in params.items() if k != "norm"},
                             make_mesh(1), jnp.float32)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tp(dataclasses.replace(cfg, num_heads=3), 2)
