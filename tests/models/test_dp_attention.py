"""DP attention's model step (``models/dp_attention.py``, ``sched/dp_batch.py``) on the
simulated CPU devices (conftest: 4): tiny DeepSeek-V3.2 and GLM-5 with attention and the DSA
indexer run per rank over their own KV pages, the MLPs over every rank's tokens (TP or EP),
give TP 1's logits and greedy tokens (tie-aware), with fewer requests than ranks (idle
ranks run an empty segment); the pool is sharded by page; the layout checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from model_utils import assert_tokens_match, top2_gaps
from pdjax.models.attention import AttentionMetadata
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.dp_attention import check_dp_attention, dp_attention_config
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


def _greedy(path, prompts, *, tp=1, dp=1, ep=1, ranks=None, kv_dtype=None):
    """Greedy continuations of ``prompts`` (one prefill step of every prompt, then ``NEW -
    1`` decode steps of every request: every step's rows all prefill or all decode), each
    request on rank ``ranks[i]`` (its own pages there). Returns ``(tokens [n][NEW], logits
    [n][NEW, V], caches)``."""
    mesh = make_mesh(tp)
    _, model = load_model(path, dtype="float32", mesh=mesh, progress=False, ep_size=ep,
                          dp_size=dp)
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
        name, kv_dtype = key if isinstance(key, tuple) else (key, None)
        tokens, logits, _ = _greedy(self.checkpoints[name], _prompts(), kv_dtype=kv_dtype)
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


def _cfg(tiny_checkpoints, name="deepseek_v32"):
    return DeepseekConfig.from_hf_dir(tiny_checkpoints[name])


def test_layout_checks(tiny_checkpoints):
    cfg = _cfg(tiny_checkpoints)
    run = dp_attention_config(cfg, 8, 4)
    assert (run.dp_size, run.attn_tp_size) == (4, 2)
    assert dp_attention_config(cfg, 4, 1) is cfg
    with pytest.raises(ValueError, match=r"^dp_size \(3\) must divide tp_size \(4\)"):
        check_dp_attention(cfg, 4, 3)
    with pytest.raises(ValueError, match=r"^dp_size must be a positive integer"):
        check_dp_attention(cfg, 4, 0)
    from pdjax.models.moe_ep import expert_parallel_config
    with pytest.raises(ValueError, match=r"^moe_a2a_backend: DP attention"):
        check_dp_attention(expert_parallel_config(cfg, 4, 4, "ragged"), 4, 4)


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
