"""The PD staging gather of KV pages: the TPU variant (one dynamic slice per page in a loop,
``_gather_pages_by_slices``) gives exactly the pages the XLA gather (``_gather_pages``, CPU
and GPU) gives, for every buffer layout the engine has, in the order asked. Its TPU memory
(no temp of a pool's size) is checked by ``tests/aot/test_target_compile.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.runner.entry_points import _gather_pages, _gather_pages_by_slices

LAYOUTS = {   # name -> {buffer: [L, N, page_size, *row]}
    "gqa": {"k_cache": (3, 12, 4, 2, 8), "v_cache": (3, 12, 4, 2, 8)},
    "gqa_rows": {"k_cache": (3, 12, 4, 16), "v_cache": (3, 12, 4, 16)},
    "mla": {"latent": (2, 12, 4, 40), "index_k": (2, 12, 4, 8)},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("pages", [[5], [7, 2, 11, 0], list(range(11, -1, -1)), [3, 3]])
def test_slices_gather_the_same_pages_as_xla_gather(layout, pages):
    rng = np.random.default_rng(len(pages))
    caches = {k: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
              for k, s in LAYOUTS[layout].items()}
    idx = jnp.asarray(pages, jnp.int32)
    want = jax.jit(_gather_pages)(caches, idx)
    got = jax.jit(_gather_pages_by_slices)(caches, idx)
    assert got.keys() == caches.keys()
    for k, v in caches.items():
        assert got[k].shape == (v.shape[0], len(pages), *v.shape[2:])
        assert got[k].dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
        np.testing.assert_array_equal(np.asarray(got[k][:, -1]), np.asarray(v[:, pages[-1]]))
