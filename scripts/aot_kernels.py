"""Compile every attention kernel for a real GPU or TPU from this CPU (deviceless AOT).

The (kernel, model shape, KV dtype, page size, TP, token bucket) matrix of
``pdjax.aot.kernel_matrix``: ragged paged attention (Llama-3 8B, Llama-3 70B at TP 8, Qwen3
32B at TP 4, SmolLM2; bf16 and fp8 KV; pages 16/32/64; decode and 2048-token mixed buckets),
MLA dense and sparse and the DSA indexer with its top-k (DeepSeek-V3.2 and GLM-5 at TP 1 and
8). Prints compile seconds and pass/fail per case; exits 1 if any case fails. Each target
needs its own venv:

    .venv-cuda/bin/python scripts/aot_kernels.py --gpu h200            # jax[cuda12]
    .venv-tpu/bin/python scripts/aot_kernels.py --topology v5e:2x2     # jax[tpu]

(``bash scripts/aot_env.sh cuda`` / ``tpu`` make the two virtualenvs.)

Options: ``--kernels rpa mla_dense mla_sparse indexer``, ``--models llama3-8b ...``,
``--page-sizes 16 64``; ``--ptxas DUMP_DIR`` (GPU) adds registers and spill stores a thread
per case. Where another process holds libtpu's lock (``/tmp/libtpu_lockfile``), a TPU run
needs ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``. Its first 84 cases (all but GLM-5) took 161-282 s a GPU
on this 2-core machine (2026-12-04, shared with other jobs).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "--gpu" in sys.argv:
    # Before JAX starts its backends: no GPU is looked for and no driver checked.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from pdjax.aot.kernel_matrix import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
