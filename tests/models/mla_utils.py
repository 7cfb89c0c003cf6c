"""Test helpers for the MLA family: run a DeepseekForCausalLM on rows of the flat token stream
with a dict of paged caches (the model's ``cache_spec``)."""

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.models.attention import AttentionMetadata
from model_utils import allocate_caches
from pdjax.sched.batch import BatchRow, build_flat_batch

PAGE = 4
NUM_PAGES = 96


@jax.jit
def _forward(model, input_ids, caches, md, logits_indices):
    return model(input_ids, caches, md, logits_indices)


def _pow2(n, lo):
    p = lo
    while p < n:
        p *= 2
    return p


def new_caches(model, num_pages=NUM_PAGES, page_size=PAGE, row_align=1):
    return allocate_caches(model.cache_spec(num_pages, page_size, row_align=row_align))


def _inputs(rows, page_size, tokens, pages, chunk_size):
    T = tokens or _pow2(sum(len(r.input_ids) for r in rows), 16)
    P = pages or _pow2(max(-(-r.kv_len // page_size) for r in rows), 4)
    fb = build_flat_batch(rows, page_size=page_size, num_tokens_pad=T, num_rows_pad=4,
                          pages_per_seq_pad=P, num_logits_pad=T, chunk_size=chunk_size)
    md = AttentionMetadata(*(jnp.asarray(a) for a in (
        fb.positions, fb.slot_mapping, fb.cu_q_lens, fb.kv_lens, fb.page_indices,
        fb.distribution)))
    return fb, (jnp.asarray(fb.input_ids), md, jnp.asarray(fb.logits_indices))


def run_rows(model, rows: list[BatchRow], caches, *, page_size=PAGE, tokens=None, pages=None,
             chunk_size=None):
    """One forward over ``rows``; returns (per-row logits arrays, caches). ``tokens`` and
    ``pages`` fix the token and pages-per-sequence buckets (default: powers of two)."""
    fb, (ids, md, logits_indices) = _inputs(rows, page_size, tokens, pages, chunk_size)
    logits, caches = _forward(model, ids, caches, md, logits_indices)
    logits = np.asarray(logits)
    return [logits[s:e] for s, e in fb.logits_row_spans], caches


def kernel_names(model, rows: list[BatchRow], caches, *, page_size=PAGE, tokens=None,
                 pages=None) -> set[str]:
    """Names of the Pallas kernels in the lowered forward (proof that the kernel path runs)."""
    import re

    _, (ids, md, logits_indices) = _inputs(rows, page_size, tokens, pages, None)
    text = _forward.lower(model, ids, caches, md, logits_indices).as_text(debug_info=True)
    return set(re.findall(r"((?:mla_\w+_attention|indexer_scores)_(?:tpu|gpu))/pallas_call", text))


def prompts(seed, lens):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 500, n)] for n in lens]
