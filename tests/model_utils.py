"""Test helpers: run a pdjax model on rows of the flat token stream, and tie-aware greedy checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.models.attention import AttentionMetadata
from pdjax.sched.batch import BatchRow, build_flat_batch


def _pow2(n, lo=16):
    p = lo
    while p < n:
        p *= 2
    return p


@jax.jit
def _forward(model, input_ids, kc, vc, md, logits_indices):
    return model(input_ids, kc, vc, md, logits_indices)


def allocate_caches(specs, mesh=None) -> dict[str, jax.Array]:
    """``{spec.name: zeros}`` of ``CacheBufferSpec``s; with a mesh each buffer is placed with
    its partition spec (the runner allocates its own pool; tests of a bare model use this)."""
    from jax.sharding import NamedSharding

    return {s.name: s.zeros(None if mesh is None else NamedSharding(mesh, s.partition))
            for s in specs}


def kv_cache_spec():
    """KV cache rows ``[L, pages, page_size, KVH * D]``: split between KV heads over ``tp``."""
    from jax.sharding import PartitionSpec

    return PartitionSpec(None, None, None, "tp")


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, **generate_kwargs):
    """transformers' greedy continuation of ``prompt`` by model ``hf``: ``(tokens, logits
    [max_new_tokens, V] float32 numpy)``; ``generate_kwargs`` go to ``hf.generate``."""
    import torch

    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                          **generate_kwargs)
    return gen.sequences[0, len(prompt):].tolist(), np.stack([l[0].numpy() for l in gen.logits])


def top2_gaps(logits) -> list[float]:
    """Per row of ``logits [n, V]``, the gap between its two largest values (tie-aware token
    checks skip positions whose gap is tiny)."""
    return [float(np.diff(np.sort(row)[-2:])[0]) for row in logits]


def new_cache(cfg, num_pages, page_size, dtype=jnp.float32, sharding=None):
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads * cfg.head_dim)
    kc = jnp.zeros(shape, dtype)
    if sharding is not None:
        kc = jax.device_put(kc, sharding)
    return kc, jnp.zeros_like(kc) if sharding is None else jax.device_put(jnp.zeros(shape, dtype), sharding)


def run_rows(model, rows: list[BatchRow], kc, vc, page_size):
    """One forward over ``rows``; returns (list of per-row logits arrays, kc, vc)."""
    T = _pow2(sum(len(r.input_ids) for r in rows))
    R = _pow2(len(rows), 4)
    P = _pow2(max(-(-r.kv_len // page_size) for r in rows), 4)
    fb = build_flat_batch(rows, page_size=page_size, num_tokens_pad=T, num_rows_pad=R,
                          pages_per_seq_pad=P, num_logits_pad=T)
    md = AttentionMetadata(*(jnp.asarray(a) for a in (
        fb.positions, fb.slot_mapping, fb.cu_q_lens, fb.kv_lens, fb.page_indices, fb.distribution)))
    logits, kc, vc = _forward(model, jnp.asarray(fb.input_ids), kc, vc, md, jnp.asarray(fb.logits_indices))
    logits = np.asarray(logits)
    return [logits[s:e] for s, e in fb.logits_row_spans], kc, vc


def assign_pages(lengths, page_size, num_pages, seed=0):
    """Disjoint, shuffled page lists for sequences of the given lengths."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(np.arange(1, num_pages)))
    out = []
    for n in lengths:
        need = -(-n // page_size)
        out.append([int(free.pop()) for _ in range(need)])
    return out


def greedy_match_len(ref_logits: np.ndarray, tokens, gap: float = 1e-3) -> int:
    """Tie-aware comparison (DESIGN.md §5): number of leading positions that must match, i.e.
    up to and including the first position whose reference top-2 logit gap is below ``gap``."""
    for i, row in enumerate(ref_logits):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < gap:
            return i
    return len(ref_logits)


def assert_tokens_match(ours, ref, ref_gaps, gap: float = 1e-3, what: str = ""):
    """Tie-aware token equality (DESIGN.md §5): equal up to and including the first position
    whose reference top-2 gap is below ``gap``; returns how many positions were compared."""
    n = len(ref)
    for i, g in enumerate(ref_gaps):
        if g < gap:
            n = i + 1
            break
    assert list(ours[:n]) == list(ref[:n]), f"{what}: {list(ours[:n])} != {list(ref[:n])}"
    return n


def top2_gaps_from_top_logprobs(tops):
    """Per position, logprob(top1) - logprob(top2) from ``output_top_logprobs`` of pdjax."""
    return [t[0][0] - t[1][0] for t in tops]


def assert_output_agrees(ref_out: dict, out: dict, what: str) -> int:
    """``out``'s greedy tokens equal ``ref_out``'s tie-aware (DESIGN.md §5) and their output
    logprobs agree within 1e-4; ``ref_out`` has ``output_top_logprobs`` (top 2). Returns how
    many positions were compared."""
    gaps = top2_gaps_from_top_logprobs(ref_out["meta_info"]["output_top_logprobs"])
    n = assert_tokens_match(out["output_ids"], ref_out["output_ids"], gaps, what=what)
    la = [x[0] for x in ref_out["meta_info"]["output_token_logprobs"][:n]]
    lb = [x[0] for x in out["meta_info"]["output_token_logprobs"][:n]]
    assert np.abs(np.array(la) - np.array(lb)).max() < 1e-4, what
    return n


def assert_speculation_keeps_tokens(engine, prompts, sampling_params: dict, what: str):
    """Generate greedy ``prompts`` with every request opting out of speculation, then
    speculating: the tokens agree tie-aware (DESIGN.md §5). Returns the speculative outputs
    and, per prompt, how many positions were compared."""
    ref = engine.generate(input_ids=prompts,
                          sampling_params={**sampling_params, "speculative": False},
                          return_logprob=True, top_logprobs_num=2)
    out = engine.generate(input_ids=prompts, sampling_params=sampling_params)
    compared = []
    for o, r in zip(out, ref):
        gaps = top2_gaps_from_top_logprobs(r["meta_info"]["output_top_logprobs"])
        compared.append(assert_tokens_match(o["output_ids"], r["output_ids"], gaps, what=what))
    return out, compared


# Token ids of the tiny checkpoints' tokenizer: prompt ids stay below it, as the HTTP server
# and the offline Engine require (the models' embeddings have 512 rows).
TINY_TOKENIZER_VOCAB = 448


def boundary_prompts(n, seed=0, page=8, chunk=16, lengths=None, vocab=TINY_TOKENIZER_VOCAB):
    """Prompts whose lengths sit at page and chunk boundaries (k*page, k*page+1, k*chunk-1,
    k*chunk+1) and in between."""
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = [page, page + 1, 2 * page, 2 * page + 1, chunk - 1, chunk + 1, 2 * chunk - 1,
                   2 * chunk + 1, 3 * chunk + 1, 1, 2, 5, 3 * page + 1, 4 * page, 40, 55]
        lengths = (lengths * (n // len(lengths) + 1))[:n]
    return [[int(x) for x in rng.integers(3, vocab, L)] for L in lengths]


def set_sched(engine, **changes):
    """Change scheduler settings of an idle engine (buckets stay the same)."""
    import dataclasses

    from pdjax.sched.scheduler import Scheduler

    core = engine.core
    assert not core.scheduler.has_work
    core.scheduler = Scheduler(dataclasses.replace(core.sched_config, **changes),
                               cost_model=core.cost_model, connector=core.scheduler.connector,
                               speculator=core.scheduler.speculator)
    core.forward.scheduler = core.scheduler       # the device half reads the same one
    return core.scheduler


def require_matmul_kernel():
    """The native CPU matmul's tests: on the CPU backend the kernel must build (a missing
    compiler fails them); on another default backend it is not registered, and they skip."""
    from pdjax.pallas_kernels.dense_cpu import matmul_kernel_status

    if jax.default_backend() != "cpu":
        pytest.skip("the native matmul is registered for the CPU platform only")
    assert matmul_kernel_status()[0], f"CPU matmul kernel unavailable: {matmul_kernel_status()[1]}"
