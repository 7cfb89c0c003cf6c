"""Run in ``.venv-tpu`` by ``test_target_compile.py``: compile, for the TPU topology in argv[1],
paged-cache reads over the engine's cache layouts (and the MLA latent's old layout), and print
one JSON object ``{case: {"pool": bytes, "temp": bytes}}`` from the compiler's
``memory_analysis``.

- ``rpa_rows``: ragged paged attention (the Mosaic kernel, decode) over a GQA pool of one
  128-wide KV head per shard, as the engine's rows ``[L, N, ps, 128]``;
- ``mla_640`` / ``mla_576``: dense MLA attention (Mosaic) over a latent pool with rows padded
  to 640 lanes (the engine's TPU layout) and compact 576-lane rows;
- ``gather_640`` / ``gather_576``: the PD staging gather of 128 pages (plain XLA) of the same
  latent pools;
- ``gather_rows_slices`` / ``gather_rows_xla``: the engine's staging gather on TPU
  (``_gather_pages_by_slices``) and XLA's gather (``_gather_pages``, its CPU and GPU one) of 16
  pages of Llama-3-8B-sized GQA rows (32 layers, 8 x 128 lanes, K and V; "pool" is one
  buffer), not donated, as the engine calls it.
Every pool is donated and returned, as the engine's steps do. The pools are large (4,097
pages): XLA lays a small argument out tiled and pads it, a large one compactly.
"""

import json
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pdjax.aot.targets import tpu_target
from pdjax.pallas_kernels.mla_sparse_attention import mla_sparse_attention
from pdjax.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pdjax.runner.entry_points import _gather_pages, _gather_pages_by_slices

LAYERS, PAGES, PAGE_SIZE, ROWS, PAGES_PER_SEQ = 4, 4097, 64, 64, 16
BF16, I32 = jnp.bfloat16, jnp.int32


def metadata():
    return [((ROWS,), I32), ((ROWS, PAGES_PER_SEQ), I32), ((ROWS + 1,), I32), ((3,), I32)]


def compile_temp(target, fn, args, donate=()):
    mesh = Mesh(target.devices[:1], ("tp",))
    sharding = NamedSharding(mesh, PartitionSpec())
    specs = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in args]
    with target.device_context():
        compiled = jax.jit(fn, donate_argnums=donate).trace(*specs).lower().compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main(topology):
    target = tpu_target(topology)
    out = {}
    for name, row in (("rpa_rows", (128,)),):
        pool = (LAYERS, PAGES, PAGE_SIZE, *row)

        def rpa(q, k, v, *md):
            return k, v, ragged_paged_attention(q, k, v, 0, *md, sm_scale=0.1, impl="tpu")
        temp = compile_temp(target, rpa, [((ROWS, 8, 128), BF16), (pool, BF16), (pool, BF16),
                                          *metadata()], donate=(1, 2))
        out[name] = {"pool": 2 * LAYERS * PAGES * PAGE_SIZE * 128 * 2, "temp": temp}
    for width in (640, 576):
        pool = (LAYERS, PAGES, PAGE_SIZE, width)

        def mla(q, latent, *md):
            return latent, mla_sparse_attention(q, latent, 0, *md, sm_scale=0.1,
                                                kv_lora_rank=512, impl="tpu")
        temp = compile_temp(target, mla, [((ROWS, 16, 576), BF16), (pool, BF16), *metadata()],
                            donate=(1,))
        out[f"mla_{width}"] = {"pool": LAYERS * PAGES * PAGE_SIZE * width * 2, "temp": temp}
        temp = compile_temp(target, lambda c, pages: (c, c[:, pages]),
                            [(pool, BF16), ((128,), I32)], donate=(0,))
        out[f"gather_{width}"] = {"pool": LAYERS * PAGES * PAGE_SIZE * width * 2, "temp": temp}
    rows = (32, 1001, 64, 8 * 128)
    for name, gather in (("gather_rows_slices", _gather_pages_by_slices),
                         ("gather_rows_xla", _gather_pages)):
        temp = compile_temp(target, lambda k, v, pages: gather({"k": k, "v": v}, pages),
                            [(rows, BF16), (rows, BF16), ((16,), I32)])
        out[name] = {"pool": 32 * 1001 * 64 * 1024 * 2, "temp": temp}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
