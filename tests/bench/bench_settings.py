"""Settings shared by the benchmark tests (a module with a unique name: several test folders
have a ``conftest.py``, so tests never import from ``conftest``)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

PAGE_SIZE = 8
# page size, pool, rows, chunk, context: one set of bucket shapes for every engine of the suite
TINY_FLAGS = ["--dtype", "float32", "--page-size", str(PAGE_SIZE), "--max-total-tokens", "4096",
              "--max-running-requests", "16", "--chunked-prefill-size", "64",
              "--context-length", "128"]
# tiny llama: 2 layers x (K, V) x page_size 8 x 2 KV heads x head_dim 16 x 4 bytes (float32)
KV_BYTES_PER_PAGE = 2 * 2 * PAGE_SIZE * 2 * 16 * 4
