"""The platform profile: how a model runs on one backend, decided once.

Three choices make the CPU fast path, and each has an "auto" that depends on the platform, the
model family, the TP size, the dtype and whether the host's C++ compiler builds the native
kernels (``PDJAX_CPU_KERNEL=0`` turns them off; ``pallas_kernels/cpu_build.py``):

- ``attention_impl``: the attention kernel (on CPU the native decode kernel, ``cpu``, beside
  the jnp path; ``xla`` where it does not build or under TP).
- ``unroll_layers``: one array per layer and an unrolled forward (on XLA CPU a layer scan
  copies each layer's weights out of the stack; DESIGN.md §2).
- ``cpu_matmul_kernel``: the linear weights stored as ``linear.PackedWeight`` for the native
  CPU matmul.

``PlatformProfile.resolve`` makes all three at once (``engine/settings.py`` calls it, once per
engine); ``prepare_model`` lays a loaded model's weights out for them (``load_model`` calls
it). The model files hold no platform flag: they call ``linear`` and read whichever layout
they hold.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pdjax.models.linear import PackedWeight
from pdjax.pallas_kernels.dense_cpu import WEIGHT_DTYPES, matmul_kernel_status
from pdjax.pallas_kernels.ragged_paged_attention import (ATTENTION_IMPLS, SINGLE_DEVICE_IMPLS,
                                                         resolve_impl)

@dataclasses.dataclass(frozen=True)
class PlatformProfile:
    """The resolved CPU-path choices for one platform (module docstring).

    ``platform``: the JAX backend (``cpu``, ``tpu``, ``gpu``). ``attention_impl``:
    ``reference``, ``xla``, ``cpu``, ``tpu`` or ``gpu``. ``unroll_layers`` /
    ``cpu_matmul_kernel``: the weight layout that ``prepare_model`` applies after loading.
    Raises ``ValueError`` naming the field for an unresolved or unknown value.
    """

    platform: str
    attention_impl: str
    unroll_layers: bool = False
    cpu_matmul_kernel: bool = False

    def __post_init__(self):
        if self.attention_impl not in ATTENTION_IMPLS or self.attention_impl == "auto":
            raise ValueError(f"attention_impl: must be a resolved implementation "
                             f"({', '.join(ATTENTION_IMPLS[1:])}); got {self.attention_impl!r}")
        for name in ("unroll_layers", "cpu_matmul_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false; got {getattr(self, name)!r}")

    @classmethod
    def resolve(cls, platform: str, *, attention_backend: str | None = None,
                unroll_layers: bool | None = None, cpu_matmul_kernel: bool | None = None,
                tp_size: int = 1, dtype=jnp.float32, layer_stack: bool = True
                ) -> PlatformProfile:
        """Resolve the three settings (``None``/``"auto"``: the platform's choice).

        ``layer_stack``: the model family stacks its layers and fuses its linear weights
        (the Llama family; DeepSeek does neither). Raises ``ValueError`` naming the field
        when a setting asked for by name cannot run here."""
        return cls(platform=platform,
                   attention_impl=_attention_impl(attention_backend, platform, tp_size),
                   unroll_layers=(platform == "cpu" and layer_stack if unroll_layers is None
                                  else unroll_layers),
                   cpu_matmul_kernel=_cpu_matmul_kernel(cpu_matmul_kernel, platform, tp_size,
                                                        dtype, layer_stack))


def _attention_impl(backend: str | None, platform: str, tp_size: int) -> str:
    """``backend`` resolved; a single-device kernel is not picked for a TP mesh (auto falls
    back to ``xla``; asked for by name it is an error)."""
    impl = resolve_impl(backend, platform)
    if impl in SINGLE_DEVICE_IMPLS and tp_size > 1:
        if backend not in (None, "auto"):
            raise ValueError(f"attention_backend: {impl!r} runs on one device; tp_size is "
                             f"{tp_size} (use 'xla' or 'auto')")
        return "xla"
    return impl


def _cpu_matmul_kernel(asked: bool | None, platform: str, tp_size: int, dtype,
                       layer_stack: bool) -> bool:
    """Auto (None): on for the Llama family on the CPU backend with ``tp_size`` 1 and float32
    or bfloat16 weights, where the kernel builds. Asked for where it cannot run, a
    ``ValueError`` that names the field and says why."""
    if asked is False:
        return False                  # nothing to check, and no kernel to build
    why = None
    if platform != "cpu":
        why = f"the backend is {platform}, not cpu"
    elif not layer_stack:
        why = "only Llama-family models pack their weights"
    elif tp_size > 1:
        why = f"it runs on one device; tp_size is {tp_size}"
    elif jnp.dtype(dtype) not in map(jnp.dtype, WEIGHT_DTYPES):
        why = f"dtype {jnp.dtype(dtype).name} is not float32 or bfloat16"
    elif not matmul_kernel_status()[0]:
        why = f"the kernel is unavailable ({matmul_kernel_status()[1]})"
    if why is not None and asked:
        raise ValueError(f"cpu_matmul_kernel: {why}")
    return why is None


def prepare_model(model, *, unroll_layers: bool = False, cpu_matmul_kernel: bool = False) -> None:
    """Lay a loaded model's weights out, in place, before its first forward: one array per
    layer (``unstack_layers``), then the linear weights packed (``fuse_linear_weights`` with
    ``PackedWeight.from_linear``; one device only, the packed layout has no TP split).
    Raises ``ValueError`` naming the setting when the model has no such layout."""
    if unroll_layers:
        if not hasattr(model, "unstack_layers"):
            raise ValueError(f"unroll_layers: {type(model).__name__} scans its layers only")
        model.unstack_layers()
    if cpu_matmul_kernel:
        if not hasattr(model, "fuse_linear_weights"):
            raise ValueError(f"cpu_matmul_kernel: {type(model).__name__} does not pack its "
                             "weights")
        model.fuse_linear_weights(PackedWeight.from_linear)
