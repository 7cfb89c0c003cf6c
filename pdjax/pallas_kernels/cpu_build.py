"""Build and register the native XLA CPU kernels (XLA FFI custom calls written in C++).

Each kernel's source (``ragged_paged_attention/kernel_cpu.cc``, ``dense_cpu/kernel_cpu.cc``, both
including ``cpu_kernel_common.h``) is compiled on first use with the host's C++ compiler
(``$CXX``, else ``c++``/``g++``/``clang++``) against the FFI headers that ship with jaxlib, for
this CPU (``-march=native``), into
``$PDJAX_CACHE_DIR/cpu_kernels/<name>_<hash>.so``; the hash covers the sources, the flags, the
compiler, jaxlib's version and the CPU, so a change of any of them builds anew. Concurrent
builders (several servers starting at once) wait on a file lock and the first one's atomic
rename. ``PDJAX_CPU_KERNEL=0`` turns every native kernel off.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from pdjax.jax_setup import pdjax_cache_dir

log = logging.getLogger(__name__)

DISABLE_ENV = "PDJAX_CPU_KERNEL"
CXX_FLAGS = ("-O3", "-march=native", "-std=gnu++17", "-shared", "-fPIC", "-fno-math-errno",
             "-ffp-contract=fast")
BUILD_TIMEOUT_S = 300
COMMON_HEADER = Path(__file__).with_name("cpu_kernel_common.h")   # included by every kernel


def compiler() -> str | None:
    """The C++ compiler to build with, or None when there is none on ``PATH``."""
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


def build_library(source: Path, cxx: str, out_dir: str) -> Path:
    """Compile ``source`` into ``out_dir`` (once per key; concurrent builders wait on a file
    lock and the first one's atomic rename); returns the shared library's path.

    Raises:
      RuntimeError: the compiler failed (its output in the message) or timed out.
    """
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    flags = (*CXX_FLAGS, f"-I{jax.ffi.include_dir()}")
    key = hashlib.sha256("\0".join(
        [source.read_text(), COMMON_HEADER.read_text(), *flags, version, jax.lib.__version__,
         _cpu_identity()]
    ).encode()).hexdigest()[:20]
    os.makedirs(out_dir, exist_ok=True)
    name = source.parent.name
    target = Path(out_dir) / f"{name}_{key}.so"
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            proc = subprocess.run([cxx, *flags, str(source), "-o", tmp],
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


def load_cpu_target(source: Path, target: str, symbol: str) -> tuple[bool, str]:
    """Build ``source``, load it and register its handler ``symbol`` as the FFI target
    ``target`` for the CPU platform. Returns ``(available, why)``: the library's path, or why
    the kernel is off (``PDJAX_CPU_KERNEL=0``, no compiler, the compiler's error). Callers
    cache the answer: registering a target twice is an error in XLA."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False, f"{DISABLE_ENV}=0"
    cxx = compiler()
    if cxx is None:
        return False, "no C++ compiler ($CXX, c++, g++ or clang++) on PATH"
    try:
        path = build_library(source, cxx, pdjax_cache_dir("cpu_kernels"))
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("native CPU kernel %s unavailable: %s", target, e)
        return False, str(e)
    return True, str(path)
