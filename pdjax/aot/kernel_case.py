"""One case of the AOT kernel matrix (``pdjax.aot.kernel_matrix``; the GEMM cases of
``pdjax.aot.gemm_cases`` too): which kernel, at which shape, KV or weight dtype, page size and
token bucket. Its own module so both builders of cases import it without importing each
other."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One compile: ``kernel`` (``"rpa"``, ``"mla_dense"``, ``"mla_sparse"``, ``"indexer"``,
    ``"gmm"``, ``"fp8_gemm"``) at ``shape`` (``kernel_matrix.AttentionShape`` or
    ``gemm_cases.GemmShape``) with a ``kv_dtype`` cache of ``page_size`` pages (a GEMM case:
    its weight dtype, page 0), for ``bucket`` (``kernel_matrix.TokenBucket``)."""

    kernel: str
    shape: Any
    kv_dtype: str
    page_size: int
    bucket: Any

    @property
    def label(self) -> str:
        return (f"{self.kernel} {self.shape.model} tp{self.shape.tp} {self.kv_dtype} "
                f"page{self.page_size} {self.bucket.name}")
