"""Registers and spills of the Pallas GPU kernels, read from the PTX that XLA compiles them to.

A GPU compile that passes can still spill: ptxas moves registers to local memory when a tile
does not fit in 255 registers a thread, which costs bandwidth on every step of the kernel. XLA
dumps each module's PTX with ``--xla_dump_to=DIR`` (read once, when the backends start); this
module runs the CUDA wheel's own ``ptxas -v`` on the dumped files of the Pallas kernels and
reads back, per kernel entry::

    ptxas info    : Compiling entry function 'ragged_paged_attention_gpu_prefill' for 'sm_90a'
    ptxas info    : Function properties for ragged_paged_attention_gpu_prefill
        176 bytes stack frame, 212 bytes spill stores, 224 bytes spill loads
    ptxas info    : Used 255 registers, used 1 barriers, 176 bytes cumulative stack size

GPU only (``jax[cuda12]``, whose ``nvidia-cuda-nvcc`` wheel ships ptxas).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess

# PTX entry names of pdjax's Pallas GPU kernels (the ``name=`` of their pallas_call).
KERNEL_ENTRY_PREFIXES = ("ragged_paged_attention_gpu", "mla_sparse_attention_gpu",
                         "mla_dense_attention_gpu", "indexer_scores_gpu", "grouped_matmul_gpu")
_ENTRY = re.compile(r"^\.(?:visible\s+)?\.entry\s+([A-Za-z_][\w$]*)", re.M)
_TARGET = re.compile(r"^\.target\s+(sm_\w+)", re.M)
_THREADS = re.compile(r"\.reqntid\s+(\d+)")
_SPILL = re.compile(r"(\d+) bytes spill stores")
_REGS = re.compile(r"Used (\d+) registers")


@dataclasses.dataclass(frozen=True)
class KernelRegisters:
    """``ptxas -v`` of one kernel entry: ``threads`` per block (-1 if the PTX does not say),
    ``registers`` per thread, ``spill_bytes`` (spill stores a thread; 0 = none)."""

    name: str
    threads: int
    registers: int
    spill_bytes: int


def ptxas_path() -> str | None:
    """The ptxas of the installed ``nvidia-cuda-nvcc`` wheel, else one on PATH, else None."""
    try:
        import nvidia.cuda_nvcc as nvcc
        path = os.path.join(list(nvcc.__path__)[0], "bin", "ptxas")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("ptxas")


def enable_ptx_dump(dump_dir: str) -> None:
    """Add ``--xla_dump_to=dump_dir`` to ``XLA_FLAGS``. Call it before JAX starts a backend
    (XLA reads the flags once); the dump holds HLO text and the PTX of every GPU module."""
    os.makedirs(dump_dir, exist_ok=True)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump_dir}").strip()


def kernel_registers(ptx_file: str, ptxas: str,
                     prefixes: tuple[str, ...] = KERNEL_ENTRY_PREFIXES) -> list[KernelRegisters]:
    """``ptxas -v`` of the kernels in one PTX file whose entry starts with one of ``prefixes``
    (none: an empty list, ptxas not run).

    Raises:
      RuntimeError: ptxas rejects the file (its message).
    """
    with open(ptx_file) as f:
        ptx = f.read()
    names = [n for n in _ENTRY.findall(ptx) if n.startswith(prefixes)]
    if not names:
        return []
    target = _TARGET.search(ptx)
    threads = _THREADS.search(ptx)
    proc = subprocess.run([ptxas, "-v", f"-arch={target.group(1) if target else 'sm_90a'}",
                           ptx_file, "-o", os.devnull], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx_file}: {proc.stderr.strip()[:500]}")
    spills = [int(s) for s in _SPILL.findall(proc.stderr)]
    regs = [int(r) for r in _REGS.findall(proc.stderr)]
    # A Pallas module holds one kernel entry: ptxas prints one block for it.
    return [KernelRegisters(name, int(threads.group(1)) if threads else -1,
                            max(regs, default=-1), max(spills, default=0)) for name in names]


class PtxWatcher:
    """The PTX files a dump folder gains between calls: ``new_kernels()`` returns the
    ``KernelRegisters`` of the pdjax kernels in files written since the last call."""

    def __init__(self, dump_dir: str, ptxas: str):
        self.dump_dir, self.ptxas = dump_dir, ptxas
        self._seen: set[str] = set()

    def new_kernels(self) -> list[KernelRegisters]:
        files = sorted(f for f in os.listdir(self.dump_dir)
                       if f.endswith(".ptx") and f not in self._seen)
        self._seen.update(files)
        out = []
        for name in files:
            out += kernel_registers(os.path.join(self.dump_dir, name), self.ptxas)
        return out
