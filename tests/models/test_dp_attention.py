"""DP attention's model step (``models/dp_attention.py``, ``sched/dp_batch.py``) on the
simulated CPU devices (conftest: 4): tiny DeepSeek-V3.2 and GLM-5 with attention and the DSA
indexer run per rank over their own KV pages, the MLPs over every rank's tokens (TP or EP),
give TP 1's logits and greedy tokens (tie-aware), with fewer requests than ranks (idle
ranks run an empty segment); the ``ragged`` dispatch from each rank's own tokens gives the
``none`` backend's and TP 1's, ``ep < tp``, two devices a rank and uneven routing included;
the pool is sharded by page; the layout checks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from model_utils import assert_tokens_match, top2_gaps
from pdjax.models.attention import AttentionMetadata
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.dp_attention import (check_dp_attention, dp_attention_config,
                                       dp_collective_bytes)
from pdjax.models.loader import load_model, make_mesh
from pdjax.sched.batch import BatchRow, build_flat_batch
from pdjax.sched.dp_batch import build_dp_batch, local_rows

PAGE_SIZE = 8
PAGES = 12                  # per rank (DP) or in all (TP 1); page 0 is the null page
NEW = 6


def _prompts(seed=0, lengths=(5, 13, 11)):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, n).tolist() for n in lengths]


def _md(fb):
    return AttentionMetadata(*(jnp.asarray(a) for a in (
        fb.positions, fb.slot_mapping, fb.cu_q_lens, fb.kv_lens, fb.page_indices,
        fb.distribution)))


def _greedy(path, prompts, *, tp=1, dp=1, ep=1, ranks=None, kv_dtype=None, backend="none",
            favored=0):
    """Greedy continuations of ``prompts`` (one prefill step of every prompt, then ``NEW -
    1`` decode steps of every request: every step's rows all prefill or all decode), each
    request on rank ``ranks[i]`` (its own pages there), MoE dispatch ``backend``.
    ``favored`` > 0: a router bias of 100 on experts ``0 .. favored - 1`` of every MoE layer
    (uneven routing: every copy to them). Returns ``(tokens [n][NEW], logits [n][NEW, V],
    caches)``."""
    mesh = make_mesh(tp)
    _, model = load_model(path, dtype="float32", mesh=mesh, progress=False, ep_size=ep,
                          dp_size=dp, moe_a2a_backend=backend)
    if favored:
        bias = model.moe.router_bias
        value = np.zeros(bias[...].shape, np.float32)
        value[:, :favored] = 100.0
        bias.set_value(jax.device_put(value, bias[...].sharding))
    graphdef, state = nnx.split(model)
    specs = model.cache_spec(PAGES, PAGE_SIZE, kv_dtype)
    caches = {s.name: s.zeros(NamedSharding(mesh, s.partition)) for s in specs}

    @jax.jit
    def step(state, caches, ids, md, li):
        logits, caches = nnx.merge(graphdef, state)(ids, caches, md, li)
        return logits, caches

    ranks = ranks or [0] * len(prompts)
    used = [1] * dp                                      # next free page of each rank
    pages = []
    for p, r in zip(prompts, ranks):
        need = -(-(len(p) + NEW) // PAGE_SIZE)
        pages.append(list(range(used[r], used[r] + need)))
        used[r] += need
    assert max(used) <= PAGES
    seqs = [list(p) for p in prompts]
    tokens = [[] for _ in prompts]
    logits_out = [[] for _ in prompts]
    for i in range(NEW):
        rows = []
        for j, seq in enumerate(seqs):
            start = 0 if i == 0 else len(seq) - 1
            rows.append(BatchRow(seq[start:], start, pages[j]))
        pad = dict(page_size=PAGE_SIZE, num_tokens_pad=32, num_rows_pad=4,
                   pages_per_seq_pad=4)
        fb = (build_flat_batch(rows, **pad) if dp == 1 else
              build_dp_batch(rows, ranks, dp_size=dp, **pad))
        logits, caches = step(state, caches, jnp.asarray(fb.input_ids), _md(fb),
                              jnp.asarray(fb.logits_indices))
        logits = np.asarray(logits)
        for j, (s, e) in enumerate(fb.logits_row_spans):
            row = logits[e - 1]
            logits_out[j].append(row)
            tokens[j].append(int(row.argmax()))
            seqs[j].append(int(row.argmax()))
    return tokens, [np.stack(l) for l in logits_out], caches


def _compare(ref, out, what):
    (ref_tokens, ref_logits), (tokens, logits) = ref, out
    compared = 0
    for j in range(len(ref_tokens)):
        n = assert_tokens_match(tokens[j], ref_tokens[j], top2_gaps(ref_logits[j]),
                                what=f"{what} request {j}")
        np.testing.assert_allclose(logits[j][:n], ref_logits[j][:n], atol=2e-4, rtol=2e-4,
                                   err_msg=what)
        compared += n
    assert compared >= len(ref_tokens) * NEW // 2, f"{what}: only {compared} compared"


class _TP1(dict):
    """name -> TP 1's (tokens, logits), computed on first use."""

    def __init__(self, checkpoints):
        super().__init__()
        self.checkpoints = checkpoints

    def __missing__(self, key):
        name, kv_dtype, favored = (*key, 0)[:3] if isinstance(key, tuple) else (key, None, 0)
        tokens, logits, _ = _greedy(self.checkpoints[name], _prompts(), kv_dtype=kv_dtype,
                                    favored=favored)
        self[key] = (tokens, logits)
        return self[key]


@pytest.fixture(scope="module")
def tp1(tiny_checkpoints):
    return _TP1(tiny_checkpoints)


_SLOW = pytest.mark.slow       # the fast tier keeps one layout (each compiles ~10 s)


@pytest.mark.parametrize("name,tp,dp,ep,ranks", [
    # 3 requests on 4 ranks: rank 1 idle; experts split by width
    ("deepseek_v32", 4, 4, 1, [2, 0, 3]),
    pytest.param("glm_moe_dsa", 4, 4, 1, [2, 0, 3], marks=_SLOW),
    # two requests on one rank, two idle ranks; EP 4
    pytest.param("deepseek_v32", 4, 4, 4, [1, 1, 3], marks=_SLOW),
    pytest.param("glm_moe_dsa", 4, 4, 4, [1, 1, 3], marks=_SLOW),
    # attn_tp 2 (each rank on 2 devices); rank 0 idle; EP 2 < TP
    pytest.param("deepseek_v32", 4, 2, 2, [1, 1, 1], marks=_SLOW),
    pytest.param("glm_moe_dsa", 4, 2, 2, [1, 1, 1], marks=_SLOW),
    # DeepSeek-V3: MLA without the DSA indexer
    pytest.param("deepseek_v3", 4, 4, 2, [3, 0, 0], marks=_SLOW),
    # FP8 block-scaled weights (TP 2: TP 4 would cut the dense layers' 128-blocks)
    pytest.param("deepseek_v32_fp8", 2, 2, 2, [1, 1, 0], marks=_SLOW),
    pytest.param("glm_moe_dsa_fp8", 2, 2, 1, [0, 1, 1], marks=_SLOW),
])
def test_dp_attention_equals_tp1(tiny_checkpoints, tp1, name, tp, dp, ep, ranks):
    tokens, logits, caches = _greedy(tiny_checkpoints[name], _prompts(), tp=tp, dp=dp, ep=ep,
                                     ranks=ranks)
    _compare(tp1[name], (tokens, logits), f"{name} tp{tp} dp{dp} ep{ep}")
    # The pool: PAGES pages a device, each rank's requests' latent rows on its own devices.
    latent = caches["latent"]
    assert latent.shape[1] == tp * PAGES
    assert {s.data.shape[1] for s in latent.addressable_shards} == {PAGES}
    a = tp // dp
    for shard in latent.addressable_shards:
        d = shard.index[1].start // PAGES
        written = np.abs(np.asarray(shard.data)[:, 1:]).sum() > 0        # past the null page
        assert written == ((d // a) in ranks), (d, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_fp8_kv_record_per_rank(tiny_checkpoints, tp1, name):
    """FP8 MLA KV (FlashMLA's record in its planes, FP8 indexer keys with scales): every plane
    sharded by page as the latent is; DP 4 equals TP 1 with the same FP8 KV."""
    fp8 = jnp.float8_e4m3fn
    tokens, logits, caches = _greedy(tiny_checkpoints[name], _prompts(), tp=4, dp=4, ep=4,
                                     ranks=[0, 2, 3], kv_dtype=fp8)
    assert {"latent", "latent_scale", "latent_rope", "indexer_k_scale"} <= set(caches)
    assert all(c.shape[1] == 4 * PAGES for c in caches.values())
    _compare(tp1[name, fp8], (tokens, logits), f"{name} fp8 kv tp4 dp4 ep4")


@pytest.mark.parametrize("name,tp,dp,ep,ranks,favored", [
    # EP 4 = TP, a device a rank; 3 requests on 4 ranks (rank 1 idle)
    ("deepseek_v32", 4, 4, 4, [2, 0, 3], 0),
    pytest.param("glm_moe_dsa", 4, 4, 4, [2, 0, 3], 0, marks=_SLOW),
    # ep < tp: EP 2, every copy to both width slices of its expert
    pytest.param("deepseek_v32", 4, 4, 2, [1, 1, 3], 0, marks=_SLOW),
    # two devices a rank, each sending its half of the rank's tokens; EP 4, and EP 2 < TP
    pytest.param("deepseek_v32", 4, 2, 4, [0, 1, 0], 0, marks=_SLOW),
    pytest.param("glm_moe_dsa", 4, 2, 2, [1, 1, 1], 0, marks=_SLOW),
    # uneven routing: every copy to rank 0's experts (0, 1 at EP 4; 0 .. 3 at EP 2)
    pytest.param("deepseek_v32", 4, 4, 4, [2, 0, 3], 2, marks=_SLOW),
    pytest.param("glm_moe_dsa", 4, 2, 2, [1, 0, 1], 4, marks=_SLOW),
    # FP8 block-scaled weights (the replicated shared experts FP8 too)
    pytest.param("deepseek_v32_fp8", 2, 2, 2, [1, 1, 0], 0, marks=_SLOW),
])
def test_dp_ragged_dispatch_equals_none_and_tp1(tiny_checkpoints, tp1, name, tp, dp, ep,
                                                ranks, favored):
    """``moe_a2a_backend ragged`` under DP attention (its padded CPU stand-in: the same
    dispatch plan): the MoE layers dispatch from each rank's own tokens, with no DP gather;
    greedy tokens and logits equal TP 1's and (slow cases) the ``none`` backend's."""
    path, what = tiny_checkpoints[name], f"{name} tp{tp} dp{dp} ep{ep} ragged"
    tokens, logits, _ = _greedy(path, _prompts(), tp=tp, dp=dp, ep=ep, ranks=ranks,
                                backend="ragged", favored=favored)
    _compare(tp1[name, None, favored], (tokens, logits), what)
    if favored or dp != 4 or ep != 4 or name != "deepseek_v32":      # slow cases
        none = _greedy(path, _prompts(), tp=tp, dp=dp, ep=ep, ranks=ranks, favored=favored)
        _compare(none[:2], (tokens, logits), f"{what} vs none")


def test_ragged_step_has_no_dp_gather_in_the_moe_layers(tiny_checkpoints):
    """The compiled DP 4 step with ragged dispatch (CPU: the padded all_to_all stand-in):
    the MoE layers' scan holds the dispatch, the ids and the combine (3 all-to-alls) and no
    DP gather; what is left is the dense layer's gather and scatter and the final gather."""
    mesh = make_mesh(4)
    _, model = load_model(tiny_checkpoints["deepseek_v32"], dtype="float32", mesh=mesh,
                          progress=False, ep_size=4, dp_size=4, moe_a2a_backend="ragged")
    graphdef, state = nnx.split(model)
    caches = {s.name: s.zeros(NamedSharding(mesh, s.partition))
              for s in model.cache_spec(PAGES, PAGE_SIZE)}
    fb = build_dp_batch([BatchRow([5, 6, 7], 0, [1])], [2], dp_size=4, page_size=PAGE_SIZE,
                        num_tokens_pad=8, num_rows_pad=2, pages_per_seq_pad=2)
    step = jax.jit(lambda st, c, i, md, li: nnx.merge(graphdef, st)(i, c, md, li))
    text = step.lower(state, caches, jnp.asarray(fb.input_ids), _md(fb),
                      jnp.asarray(fb.logits_indices)).compile().as_text()
    ops = {k: len(re.findall(rf"\b{k}(?:-start)?\(", text))
           for k in ("all-gather", "reduce-scatter", "all-to-all")}
    assert ops == {"all-gather": 2, "reduce-scatter": 1, "all-to-all": 3}, ops


def test_ragged_sends_only_the_real_tokens(tiny_checkpoints):
    """``moe_forward_dp_ragged`` inside a DP 4 ``shard_map`` with each rank's real token
    count: the real rows equal ``moe_forward``'s, the segment's padding rows get no routed
    output (only the shared experts'): they were not dispatched."""
    from jax.sharding import Mesh, PartitionSpec as P

    from pdjax.models.moe import moe_forward, swiglu
    from pdjax.models.moe_ep import expert_parallel_config, moe_forward_dp_ragged

    cfg = _cfg(tiny_checkpoints)
    run = dp_attention_config(expert_parallel_config(cfg, 4, 4, "ragged"), 4, 4)
    rng = np.random.default_rng(3)
    E, Hd, Fm = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    w = lambda *shape: rng.normal(0, 0.3, shape).astype(np.float32)       # noqa: E731
    p = {"router": w(Hd, E), "router_bias": np.zeros(E, np.float32), "w_gate": w(E, Hd, Fm),
         "w_up": w(E, Hd, Fm), "w_down": w(E, Fm, Hd), "sh_gate": w(Hd, Fm),
         "sh_up": w(Hd, Fm), "sh_down": w(Fm, Hd)}
    Ts, real = 8, np.array([3, 0, 5, 8], np.int32)
    h = rng.normal(0, 1, (4 * Ts, Hd)).astype(np.float32)
    specs = {n: P("tp") if n in ("w_gate", "w_up", "w_down") else P() for n in p}

    def body(h, real, p):
        r = jax.lax.axis_index("tp")
        h_r = jax.lax.dynamic_slice_in_dim(h, r * Ts, Ts)
        return moe_forward_dp_ragged(run, h_r, p, padded=True, num_tokens=real[r])

    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    out = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), specs),
                                           out_specs=P("tp"), check_vma=False))(h, real, p))
    ref = np.asarray(moe_forward(cfg, jnp.asarray(h), p))
    shared = np.asarray(swiglu(jnp.asarray(h), p["sh_gate"], p["sh_up"], p["sh_down"]))
    is_real = (np.arange(4 * Ts) % Ts) < np.repeat(real, Ts)
    np.testing.assert_allclose(out[is_real], ref[is_real], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out[~is_real], shared[~is_real], atol=1e-4, rtol=1e-4)
    assert np.abs(ref[~is_real] - shared[~is_real]).max() > 1e-2    # routed output left out


def _cfg(tiny_checkpoints, name="deepseek_v32"):
    return DeepseekConfig.from_hf_dir(tiny_checkpoints[name])


def test_layout_checks(tiny_checkpoints):
    cfg = _cfg(tiny_checkpoints)
    run = dp_attention_config(cfg, 8, 4)
    assert (run.dp_size, run.attn_tp_size) == (4, 2)
    assert dp_attention_config(cfg, 4, 1) is cfg
    with pytest.raises(ValueError, match=r"^dp_size: 3 must divide tp_size \(4\)"):
        check_dp_attention(cfg, 4, 3)
    with pytest.raises(ValueError, match=r"^dp_size: must be a positive integer"):
        check_dp_attention(cfg, 4, 0)
    from pdjax.models.moe_ep import expert_parallel_config
    ragged = dp_attention_config(expert_parallel_config(cfg, 4, 4, "ragged"), 4, 4)
    assert (ragged.moe_a2a_backend, ragged.dp_size, ragged.ep_size) == ("ragged", 4, 4)


def test_ragged_layout_replicates_the_shared_experts(tiny_checkpoints):
    """Under DP attention the ragged backend runs the shared experts on each device's own
    tokens: their weights are whole on every device; routed experts split by expert; the
    none backend keeps the shared experts split over tp."""
    from pdjax.models.deepseek_params import param_groups
    from pdjax.models.moe_ep import expert_parallel_config
    from jax.sharding import PartitionSpec as P

    cfg = _cfg(tiny_checkpoints)
    for backend, shared in (("ragged", P()), ("none", P(None, "tp"))):
        run = dp_attention_config(expert_parallel_config(cfg, 4, 4, backend), 4, 4)
        moe = param_groups(run)["moe"][1]
        assert moe["sh_gate"][1] == shared and moe["sh_up"][1] == shared
        assert moe["w_gate"][1] == P("tp", None, None)


def test_collective_bytes_by_backend(tiny_checkpoints):
    """``dp_collective_bytes``: the none backend gathers and scatters at every layer; ragged
    at the dense layer only, plus (two devices a rank) the MoE layers' slice permutes."""
    from pdjax.models.moe_ep import expert_parallel_config

    cfg = _cfg(tiny_checkpoints)         # 3 layers: 1 dense, 2 MoE; hidden 64
    Ts, item = 8, 4
    none = dp_attention_config(expert_parallel_config(cfg, 4, 4, "none"), 4, 4)
    assert dp_collective_bytes(none, Ts, item) == (2 * 3 + 1) * 3 * Ts * 64 * item
    ragged = dp_attention_config(expert_parallel_config(cfg, 4, 4, "ragged"), 4, 4)
    assert dp_collective_bytes(ragged, Ts, item) == (2 * 1 + 1) * 3 * Ts * 64 * item
    ragged2 = dp_attention_config(expert_parallel_config(cfg, 4, 4, "ragged"), 4, 2)
    assert dp_collective_bytes(ragged2, 7, item) == ((2 + 1) * 3 * 7 + 2 * 1 * 4) * 64 * item


def test_llama_refuses_dp_attention(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"^enable_dp_attention: llama models cannot"):
        load_model(tiny_checkpoints["llama"], dtype="float32", mesh=make_mesh(2),
                   progress=False, dp_size=2)


def test_dp_batch_layout():
    """Rows with global page ids (4 pages a rank) -> rank-local pages; each rank's segment;
    logits rows in the given row order (row 1 is on rank 2, after rank 0's rows)."""
    rows, ranks = local_rows([BatchRow([7], 3, [3]), BatchRow([9, 8], 0, [10]),
                              BatchRow([1, 2, 3], 0, [1])], pages_per_rank=4)
    assert ranks == [0, 2, 0] and [r.pages for r in rows] == [[3], [2], [1]]
    b = build_dp_batch(rows, ranks, dp_size=3, page_size=4, num_tokens_pad=8,
                       num_rows_pad=2, pages_per_seq_pad=2)
    assert b.input_ids.tolist() == [7, 1, 2, 3, 0, 0, 0, 0] + [0] * 8 + [9, 8, 0, 0, 0, 0, 0, 0]
    assert b.slot_mapping[0, :4].tolist() == [15, 4, 5, 6] and b.slot_mapping[1].sum() == 0
    assert b.kv_lens.tolist() == [[4, 3], [0, 0], [2, 0]]
    assert b.distribution.tolist() == [[1, 1, 2], [0, 0, 0], [0, 0, 1]]
    assert b.logits_indices.tolist() == [0, 17, 3, 0, 0, 0]      # rows 0, 1, 2; padding
    assert b.logits_row_spans == [(0, 1), (1, 2), (2, 3)]
    assert b.row_starts == [0, 16, 1] and b.num_tokens == 6
    with pytest.raises(ValueError, match=r"^rank 1: 9 tokens exceed"):
        build_dp_batch([BatchRow(list(range(9)), 0, [1, 2, 3])], [1], dp_size=2, page_size=4,
                       num_tokens_pad=8, num_rows_pad=2, pages_per_seq_pad=3)
    with pytest.raises(ValueError, match=r"pages \[3, 5\] are not all on rank 0"):
        local_rows([BatchRow([1, 2], 0, [3, 5])], pages_per_rank=4)
