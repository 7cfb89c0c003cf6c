"""pdjax Llama/Qwen2/Qwen3 vs transformers on tiny random checkpoints, paged consistency, TP."""

import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model_utils import assign_pages, new_cache, require_matmul_kernel, run_rows
from pdjax.models.linear import PackedWeight
from model_utils import kv_cache_spec
from pdjax.models.loader import load_model, make_mesh
from pdjax.models.platform import prepare_model
from pdjax.sched.batch import BatchRow

PAGE = 4
PROMPT_LENS = (5, 16, 17, 33)


def _prompts(seed=0, lens=PROMPT_LENS):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 500, n)] for n in lens]


def _prefill_all(model, cfg, prompts, mesh=None, seed=0):
    sharding = NamedSharding(mesh, kv_cache_spec()) if mesh is not None else None
    kc, vc = new_cache(cfg, 64, PAGE, sharding=sharding)
    pages = assign_pages([len(p) for p in prompts], PAGE, 64, seed)
    rows = [BatchRow(p, 0, pg, logits_start=0) for p, pg in zip(prompts, pages)]
    logits, _, _ = run_rows(model, rows, kc, vc, PAGE)
    return logits


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_logits_match_transformers(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    cfg, model = load_model(path, dtype="float32", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts()
    ours = _prefill_all(model, cfg, prompts)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() < 1e-4, name
        assert np.abs(ref).max() > 1.0   # a real signal, not near-uniform logits


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_paged_consistency_chunked_and_decode(tiny_checkpoints, name):
    """One-shot prefill == chunks of 16 == token-by-token decode, on shuffled page tables."""
    cfg, model = load_model(tiny_checkpoints[name], dtype="float32", progress=False)
    prompt = _prompts(1, (45,))[0]
    full = _prefill_all(model, cfg, [prompt])[0]
    for step, seed in ((16, 3), (1, 4)):
        kc, vc = new_cache(cfg, 64, PAGE)
        pages = assign_pages([len(prompt)], PAGE, 62, seed)[0]
        got = []
        for start in range(0, len(prompt), step):
            chunk = prompt[start:start + step]
            # Another request shares the batch, so rows sit at non-zero offsets.
            other = BatchRow([7, 8, 9][: 1 + start % 3], 0, [63])
            logits, kc, vc = run_rows(model, [other, BatchRow(chunk, start, pages, logits_start=0)],
                                      kc, vc, PAGE)
            got.append(logits[1])
        got = np.concatenate(got)
        assert got.shape == full.shape
        assert np.abs(got - full).max() < 1e-4, (name, step)


@pytest.mark.parametrize("name,tp,unroll", [("llama", 2, False), ("llama", 4, False),
                                             ("llama_tied", 2, False), ("qwen2", 2, False),
                                             ("llama", 2, True)])
def test_tensor_parallel_matches_single_device(tiny_checkpoints, name, tp, unroll):
    """TP over simulated CPU devices; llama (2 KV heads) at TP 4 and llama_tied (1 KV head)
    replicate KV heads. ``unroll``: the per-layer arrays keep the stack's split."""
    path = tiny_checkpoints[name]
    cfg1, model1 = load_model(path, dtype="float32", progress=False)
    mesh = make_mesh(tp)
    cfg_tp, model_tp = load_model(path, dtype="float32", mesh=mesh, progress=False)
    assert cfg_tp.num_kv_heads == max(cfg1.num_kv_heads, tp)
    wq = model_tp.layers.wq[...]
    assert len(wq.sharding.device_set) == tp
    if unroll:
        prepare_model(model_tp, unroll_layers=True)
        for w in model_tp.layers.wq.get_value():      # [H, QH * D], heads over "tp"
            assert w.sharding.spec == P(None, "tp") and len(w.sharding.device_set) == tp
            assert w.addressable_shards[0].data.shape == (w.shape[0], w.shape[1] // tp)
        for w in model_tp.layers.w_down.get_value():  # [F, H], rows over "tp"
            assert w.sharding.spec == P("tp", None)
    prompts = _prompts(2)
    ref = _prefill_all(model1, cfg1, prompts)
    got = _prefill_all(model_tp, cfg_tp, prompts, mesh=mesh)
    for a, b in zip(ref, got):
        assert np.abs(a - b).max() < 1e-4


def test_tp_size_that_does_not_divide_heads_is_rejected(tiny_checkpoints):
    with pytest.raises(ValueError, match="tp_size"):
        load_model(tiny_checkpoints["qwen3"], dtype="float32", mesh=make_mesh(3), progress=False)


def test_bfloat16_close_to_float32(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"]
    cfg, m32 = load_model(path, dtype="float32", progress=False)
    _, m16 = load_model(path, dtype="bfloat16", progress=False)
    assert m16.layers.wq[...].dtype.name == "bfloat16"
    prompts = _prompts(3, (20,))
    a = _prefill_all(m32, cfg, prompts)[0]
    import jax.numpy as jnp

    kc, vc = new_cache(cfg, 64, PAGE, dtype=jnp.bfloat16)
    pages = assign_pages([20], PAGE, 64)
    b, _, _ = run_rows(m16, [BatchRow(prompts[0], 0, pages[0], logits_start=0)], kc, vc, PAGE)
    rel = np.abs(a - b[0]).max() / np.abs(a).max()
    assert rel < 0.05
    assert (np.argmax(a, -1) == np.argmax(b[0], -1)).mean() > 0.8


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_unrolled_layers_match_the_scan(tiny_checkpoints, name):
    """``unroll_layers``: per-layer arrays (the stack's values, layer by layer) and a forward
    whose logits equal the scan's, prefill and chunked decode alike."""
    path = tiny_checkpoints[name]
    cfg, scanned = load_model(path, dtype="float32", progress=False)
    _, model = load_model(path, dtype="float32", progress=False, unroll_layers=True)
    stacked = {n: np.asarray(getattr(scanned.layers, n)[...]) for n in ("wq", "w_down", "input_norm")}
    model.unstack_layers()                        # idempotent
    for n, want in stacked.items():
        got = getattr(model.layers, n).get_value()
        assert isinstance(got, tuple) and len(got) == cfg.num_layers
        for i, w in enumerate(got):
            np.testing.assert_array_equal(np.asarray(w), want[i])
    prompts = _prompts(4)
    for a, b in zip(_prefill_all(scanned, cfg, prompts), _prefill_all(model, cfg, prompts)):
        assert np.abs(a).max() > 1.0
        assert np.abs(a - b).max() < 1e-4, name
    # A decode row after a chunk, next to another request: the cache the unrolled forward
    # wrote per layer is the one it reads back.
    (want, _), (got, _) = (_chunk_then_decode(m, cfg) for m in (scanned, model))
    assert np.abs(want[1] - got[1]).max() < 1e-4


def _chunk_then_decode(model, cfg):
    """A 20-token chunk, then its last token as a decode row next to another request's two
    tokens: ``(per-row logits of the second forward, the K cache after it)``."""
    prompt = _prompts(5, (21,))[0]
    pages = assign_pages([len(prompt)], PAGE, 62, 7)[0]
    kc, vc = new_cache(cfg, 64, PAGE)
    _, kc, vc = run_rows(model, [BatchRow(prompt[:20], 0, pages)], kc, vc, PAGE)
    logits, kc, _ = run_rows(model, [BatchRow([7, 8], 0, [63]), BatchRow(prompt[20:], 20, pages)],
                             kc, vc, PAGE)
    return logits, np.asarray(kc)


def test_unroll_layers_is_refused_by_the_deepseek_family(tiny_checkpoints):
    for flag in ("unroll_layers", "cpu_matmul_kernel"):
        with pytest.raises(ValueError, match=flag):
            load_model(tiny_checkpoints["deepseek_v3"], dtype="float32", progress=False,
                       **{flag: True})


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen3"])
@pytest.mark.parametrize("unrolled", [False, True], ids=["scanned", "unrolled"])
def test_packed_weights_match_xla_dots(tiny_checkpoints, name, unrolled):
    """``cpu_matmul_kernel`` (``PackedWeight``, the native CPU matmul) on a stacked or unrolled model, with a tied or
    untied LM head, q/k/v biases (Qwen2) and q/k norms (Qwen3): the unpacked weights are gone,
    and prefill, chunked decode next to another request, and the cache it wrote give the XLA
    forward's logits within float32 rounding."""
    require_matmul_kernel()
    path = tiny_checkpoints[name]
    cfg, plain = load_model(path, dtype="float32", progress=False)
    _, model = load_model(path, dtype="float32", progress=False)
    prepare_model(model, unroll_layers=unrolled, cpu_matmul_kernel=True)
    model.fuse_linear_weights(PackedWeight.from_linear)      # idempotent
    assert not hasattr(model.layers, "wq") and isinstance(model.lm_head.get_value(), PackedWeight)
    wqkv = model.layers.wqkv.get_value()
    assert isinstance(wqkv, tuple) is unrolled
    assert all(isinstance(w, PackedWeight) for w in (wqkv if unrolled else (wqkv,)))
    prompts = _prompts(6)
    for a, b in zip(_prefill_all(plain, cfg, prompts), _prefill_all(model, cfg, prompts)):
        assert np.abs(a).max() > 1.0
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * np.abs(a).max())
    (want, want_k), (got, got_k) = (_chunk_then_decode(m, cfg) for m in (plain, model))
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * np.abs(a).max())
    np.testing.assert_allclose(got_k, want_k, rtol=0, atol=1e-5)
