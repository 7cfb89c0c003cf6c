"""Decode attention as a native XLA CPU kernel: ``kernel_cpu.cc``, an XLA FFI custom call.

Why: on XLA CPU the jnp decode path (``xla.decode_attention``) first gathers each row's pages
into a contiguous block and then runs small batched dots over it, so every key and value is
written and read again, and the dots run far below the memory's speed; a 16-row SmolLM2 decode
step spent 42 of its 95 ms in attention that way (BENCHMARKS.md). The kernel reads each row's
keys and values once, in place in the stacked paged cache, for all the query heads of a KV head
at a time (DESIGN.md §2).

The source is compiled on first use with the host's C++ compiler (``$CXX``, else ``c++``/``g++``)
against the FFI headers that ship with jaxlib, for this CPU (``-march=native``), into
``$PDJAX_CACHE_DIR/cpu_kernels/<hash>.so``; the hash covers the source, the flags, the compiler,
jaxlib's version and the CPU, so a change of any of them builds anew. ``PDJAX_CPU_KERNEL=0``
turns the kernel off. Where it cannot be built, ``cpu_kernel_status()`` says why and the
attention dispatch (``resolve_impl``) keeps the jnp path.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.jax_setup import pdjax_cache_dir

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("kernel_cpu.cc")
FFI_TARGET = "pdjax_paged_decode_attention"
HANDLER_SYMBOL = "PdjaxPagedDecodeAttention"
DISABLE_ENV = "PDJAX_CPU_KERNEL"
CACHE_DTYPES = (jnp.float32, jnp.bfloat16)
CXX_FLAGS = ("-O3", "-march=native", "-std=gnu++17", "-shared", "-fPIC", "-fno-math-errno",
             "-ffp-contract=fast")
BUILD_TIMEOUT_S = 300


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def build_library(cxx: str, out_dir: str) -> Path:
    """Compile ``kernel_cpu.cc`` into ``out_dir`` (once per key; concurrent builders wait on a
    file lock and the first one's atomic rename); returns the shared library's path.

    Raises:
      RuntimeError: the compiler failed (its output in the message) or timed out.
    """
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    flags = (*CXX_FLAGS, f"-I{jax.ffi.include_dir()}")
    key = hashlib.sha256("\0".join(
        [KERNEL_SOURCE.read_text(), *flags, version, jax.lib.__version__, _cpu_identity()]
    ).encode()).hexdigest()[:20]
    os.makedirs(out_dir, exist_ok=True)
    target = Path(out_dir) / f"kernel_cpu_{key}.so"
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            proc = subprocess.run([cxx, *flags, str(KERNEL_SOURCE), "-o", tmp],
                                  capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"{cxx} failed ({proc.returncode}): {proc.stderr[-2000:]}")
            os.replace(tmp, target)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{cxx} took over {BUILD_TIMEOUT_S} s") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def cpu_kernel_status() -> tuple[bool, str]:
    """``(available, why)``: whether the kernel is built, loaded and registered with XLA for
    the CPU platform in this process (once; later calls return the first answer)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False, f"{DISABLE_ENV}=0"
    cxx = _compiler()
    if cxx is None:
        return False, "no C++ compiler ($CXX, c++, g++ or clang++) on PATH"
    try:
        path = build_library(cxx, pdjax_cache_dir("cpu_kernels"))
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(
            FFI_TARGET, jax.ffi.pycapsule(getattr(lib, HANDLER_SYMBOL)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("CPU attention kernel unavailable, using the jnp path: %s", e)
        return False, str(e)
    return True, str(path)


def cpu_kernel_available() -> bool:
    return cpu_kernel_status()[0]


def supports(q: jax.Array, k_cache: jax.Array, k_scale, v_scale) -> bool:
    """Whether the kernel takes this query and cache: a float32 or bfloat16 cache, static
    scales or None, and a head_dim that is a multiple of 8 (its vector width)."""
    return (k_cache.dtype in CACHE_DTYPES and q.shape[-1] % 8 == 0
            and all(s is None or isinstance(s, (int, float)) for s in (k_scale, v_scale)))


def decode_attention_cpu(q, k_cache, v_cache, layer, kv_lens, page_indices, num_rows, *,
                         sm_scale, sliding_window=None, soft_cap=None, k_scale=None,
                         v_scale=None):
    """``xla.decode_attention``'s contract through the native kernel.

    Args:
      q: ``[n, QH, D]`` the decode rows' queries (any float dtype; computed in float32).
      k_cache, v_cache: ``[layers, num_pages, page_size, KVH, D]`` float32 or bfloat16.
      layer: int32 scalar; kv_lens ``[R]``, page_indices ``[R, P]`` int32 with ``R >= n``.
      num_rows: int32 scalar: rows ``[0, num_rows)`` are decode rows; the rest give 0.
      sm_scale, sliding_window, soft_cap, k_scale, v_scale: as in the reference (the query sits
        at position ``kv_lens[r] - 1``; scales are static floats or None).

    Returns:
      ``[n, QH, D]`` float32; rows past ``num_rows`` and rows with kv_len 0 are 0.

    Raises:
      RuntimeError: the kernel is not available (``cpu_kernel_status()`` says why).
      ValueError: a cache dtype the kernel does not take.
    """
    ok, why = cpu_kernel_status()
    if not ok:
        raise RuntimeError(f"CPU attention kernel unavailable: {why}")
    if not supports(q, k_cache, k_scale, v_scale):
        raise ValueError(f"k_cache/q: the CPU kernel does not take a {k_cache.dtype} cache with "
                         f"q {q.shape} (see kernel_cpu.supports)")
    n = q.shape[0]
    call = jax.ffi.ffi_call(FFI_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q.astype(jnp.float32), k_cache, v_cache,
                jnp.asarray(layer, jnp.int32).reshape(()), kv_lens[:n].astype(jnp.int32),
                page_indices[:n].astype(jnp.int32), jnp.asarray(num_rows, jnp.int32).reshape(()),
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0),
                k_scale=np.float32(1.0 if k_scale is None else k_scale),
                v_scale=np.float32(1.0 if v_scale is None else v_scale))
