"""Test helpers shared by the kernel tests (tests/pallas_kernels) and the MLA model tests: the
paged batch layout with NaN where no request reads, where a kernel runs (interpreted or
compiled), and lowering for an abstract GPU. Imports only jax and numpy (the GPU check host has
little else)."""

import contextlib
import dataclasses

import jax
import numpy as np

ON_GPU = jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """The metadata of one batch in a fixed envelope (DESIGN.md §2) and which pages it holds.

    ``kv_lens [R]``, ``cu_q_lens [R+1]``, ``page_indices [R, P]`` int32; ``need [R]``: pages
    request ``r`` holds (its first ``need[r]`` page-table entries); ``used [N]``: pages some
    request holds. The other page-table entries are random pages, as the kernels must ignore
    them.
    """

    kv_lens: np.ndarray
    cu_q_lens: np.ndarray
    page_indices: np.ndarray
    need: np.ndarray
    used: np.ndarray
    page_size: int

    def poison(self, cache: np.ndarray) -> None:
        """NaN, in place, in ``cache [L, N, page_size, ...]`` wherever no request reads: unused
        pages and the slots past ``kv_lens`` in each request's last page."""
        cache[:, ~self.used] = np.nan
        for r, n in enumerate(self.need):
            tail = self.kv_lens[r] % self.page_size
            if n and tail:
                cache[:, self.page_indices[r, n - 1], tail:] = np.nan


def paged_layout(rng: np.random.Generator, seqs, *, num_seqs: int, num_pages: int,
                 pages_per_seq: int, page_size: int) -> PagedLayout:
    """``seqs``: ``(q_len, kv_len)`` of the first requests; the rest of the ``num_seqs`` rows are
    padding (0, 0). Each request gets distinct pages, a random permutation of ``1..N-1`` (page 0
    is the null page)."""
    q_lens = np.zeros(num_seqs, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    q_lens[:len(seqs)] = [s[0] for s in seqs]
    kv_lens[:len(seqs)] = [s[1] for s in seqs]
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    need = -(-kv_lens // page_size)
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = rng.integers(0, num_pages, (num_seqs, pages_per_seq)).astype(np.int32)
    used = np.zeros(num_pages, bool)
    start = 0
    for r, n in enumerate(need):
        page_indices[r, :n] = perm[start:start + n]
        used[perm[start:start + n]] = True
        start += n
    return PagedLayout(kv_lens, cu_q_lens, page_indices, need, used, page_size)


def interpret_mode(impl: str) -> bool:
    """Kernels run through the Pallas interpreter but for the GPU kernel on a GPU host."""
    return not (ON_GPU and impl == "gpu")


def kernel_device(impl: str):
    """Interpreted kernels run on the CPU device, also on a GPU host."""
    if interpret_mode(impl) and jax.default_backend() != "cpu":
        return jax.default_device(jax.devices("cpu")[0])
    return contextlib.nullcontext()


def lowering_context(platform: str):
    """jax 0.11 lowers Triton kernels only for a known GPU: without one, name an abstract H200
    (jax 0.10 falls back to sm_90 by itself)."""
    if platform != "cuda" or jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                         platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))
