"""Which layout of FP8 GQA KV scales can a TPU kernel fetch per page? (DESIGN.md §5)

The FP8 GQA cache keeps one float32 scale per token per KV head beside each K / V page. A TPU
attention kernel fetches a request's pages with one DMA each (``kernel_tpu.py``), so it needs
``scales.at[layer, page]`` to be a block XLA:TPU can hand to a Pallas call as it lies in HBM.
This compiles a kernel that DMAs four pages of a ``[L, N, ...]`` float32 scale buffer, in three
layouts, for a TPU (deviceless, libtpu: run it with ``.venv-tpu``), and prints the temporary
bytes each needs: a temporary as large as the buffer means XLA re-lays the whole buffer out
for the call, on every call.

    token-major  [L, N, page_size, KVH]    (the CPU / GPU layout today)
    head-major   [L, N, KVH, page_size]
    flat         [L, N, page_size * KVH]

Usage: .venv-tpu/bin/python scripts/aot_kv_scale_layout.py [--topology v5e:2x2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = {"token-major": lambda ps, h: (ps, h), "head-major": lambda ps, h: (h, ps),
           "flat": lambda ps, h: (ps * h,)}


def temp_bytes(target, shape) -> int:
    """Temporary bytes of a Pallas call that DMAs pages 0-3 of layer 1 of a float32
    ``shape`` buffer ``[L, N, ...]`` into VMEM, compiled for ``target``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import SingleDeviceSharding

    page = shape[2:]

    def kernel(pages_ref, scales_hbm, o_ref, buf, sem):
        for i in range(4):
            copy = pltpu.make_async_copy(scales_hbm.at[1, pages_ref[i]], buf.at[i], sem.at[0])
            copy.start()
            copy.wait()
        o_ref[...] = buf[...]

    def call(pages, scales):
        return pl.pallas_call(kernel, grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((4, *page), lambda b, p: (0,) * (1 + len(page))),
            scratch_shapes=[pltpu.VMEM((4, *page), jnp.float32), pltpu.SemaphoreType.DMA((1,))]),
            out_shape=jax.ShapeDtypeStruct((4, *page), jnp.float32))(pages, scales)

    on = SingleDeviceSharding(target.devices[0])
    with target.device_context():
        compiled = jax.jit(call).trace(
            jax.ShapeDtypeStruct((4,), jnp.int32, sharding=on),
            jax.ShapeDtypeStruct(shape, jnp.float32, sharding=on)).lower().compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-pages", type=int, default=4096)
    ns = parser.parse_args(argv)
    from pdjax.aot.targets import tpu_target

    target = tpu_target(ns.topology)
    print(f"{ns.topology}: float32 scales of {ns.layers} layers x {ns.num_pages} pages")
    print(f"{'layout':12s} {'page':>5s} {'KVH':>4s} {'buffer MiB':>11s} {'temp MiB':>9s}")
    for page_size, kv_heads in ((16, 2), (16, 8), (32, 8)):
        for name, page in LAYOUTS.items():
            shape = (ns.layers, ns.num_pages, *page(page_size, kv_heads))
            nbytes = 4 * ns.layers * ns.num_pages * page_size * kv_heads
            temp = temp_bytes(target, shape)
            print(f"{name:12s} {page_size:5d} {kv_heads:4d} {nbytes / 2**20:11.1f} "
                  f"{temp / 2**20:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
