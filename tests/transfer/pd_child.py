"""``python -m pdjax.serve`` with test-only hooks, injected here and never in the package:

    python tests/transfer/pd_child.py [--shuffle-free-pages SEED] [--corrupt-backend] \\
        -- <pdjax.serve arguments>

``--shuffle-free-pages SEED``: the page allocator hands out pages in a seeded random order, now
and after later frees (``PageAllocator.shuffle``), so page lists break into many runs, as
the tests of copy counts need. ``--corrupt-backend``: registers the ``mooncake-corrupt``
transfer backend (``corrupt_backend.py``); its flipped byte is the high byte of the first
element of the KV cache's dtype (the top exponent bit of a little-endian value).
``--jax-pull-delay-file PATH``: registers the ``jax-slow`` backend (``jax_slow_backend.py``):
the decode waits the seconds PATH holds (while it exists) before each pull.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if "--" not in argv:
        raise SystemExit("usage: pd_child.py [hooks] -- <pdjax.serve arguments>")
    split = argv.index("--")
    hooks = argparse.ArgumentParser(prog="pd_child.py")
    hooks.add_argument("--shuffle-free-pages", type=int, default=None)
    hooks.add_argument("--corrupt-backend", action="store_true")
    hooks.add_argument("--jax-pull-delay-file", default=None)
    opts = hooks.parse_args(argv[:split])
    serve_argv = argv[split + 1:]

    from pdjax import serve

    if opts.shuffle_free_pages is not None:
        from pdjax.kv.allocator import PageAllocator

        init, seed = PageAllocator.__init__, opts.shuffle_free_pages

        def shuffled_init(self, num_pages: int) -> None:
            init(self, num_pages)
            self.shuffle(seed)

        PageAllocator.__init__ = shuffled_init
    if opts.corrupt_backend:
        import numpy as np

        import corrupt_backend
        from pdjax.engine.settings import resolve_engine_config

        corrupt_backend.register()     # parse_args below must accept the name
        args = serve.parse_args(serve_argv)
        itemsize = np.dtype(resolve_engine_config(args).kv_dtype).itemsize
        corrupt_backend.register(corrupt_offset=itemsize - 1)
    if opts.jax_pull_delay_file is not None:
        import jax_slow_backend

        jax_slow_backend.register(opts.jax_pull_delay_file)
    return serve.main(serve_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
