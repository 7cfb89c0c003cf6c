"""Compile-only devices of a real accelerator, on a machine without one (deviceless AOT).

A ``Target`` names an accelerator and holds JAX devices of it that can compile but not run:

* TPU: ``jax.experimental.topologies.get_topology_desc(topology_name="v5e:2x2",
  platform="tpu")`` gives one compile-only device per chip of the topology; libtpu's own
  compiler (Mosaic for Pallas kernels) runs on the CPU. Needs ``jax[tpu]`` (libtpu) installed.
* GPU: ``get_topology_desc(platform="cuda", target_config=<GpuTargetConfig text proto>,
  topology="1x1x1")`` with a target config kept in ``pdjax/aot/gpu_targets/`` (``h100``,
  ``h200``); XLA, Triton and ptxas compile for it with no driver. Needs ``jax[cuda12]``,
  ``CUDA_VISIBLE_DEVICES=-1`` and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
  (``gpu_environment``).

The anchors are MaxText's ``train_compile.py`` and axlearn's ``run_aot_compilation.py``, which
size TPU pods from a CPU the same way.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

GPU_TARGETS_DIR = os.path.join(os.path.dirname(__file__), "gpu_targets")
# Accelerators whose HBM per chip the budget table needs when the device does not say.
HBM_BYTES_PER_CHIP = {
    "v4": 32 << 30, "v5e": 16 << 30, "v5p": 95 << 30, "v6e": 32 << 30,
    "h100": 80 << 30, "h200": 141 << 30,
}
_TPU_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e)[:-]\d+(x\d+){0,2}$")


@dataclasses.dataclass(frozen=True)
class Target:
    """Compile-only devices of one accelerator kind.

    ``name``: what the user asked for (``"v5e:2x2"``, ``"h200"``); ``platform``: ``"tpu"`` or
    ``"gpu"`` (the attention kernels' platform name); ``devices``: the compile-only devices
    (one per chip: a mesh takes its first ``tp * dp``); ``chip``: the short chip name
    (``"v5e"``, ``"h200"``); ``hbm_bytes``: HBM per chip in bytes.
    """

    name: str
    platform: str
    devices: tuple[Any, ...]
    chip: str
    hbm_bytes: int

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    def device_context(self):
        """Trace, lower and compile under this: Pallas's lowering reads the chip (TPU
        generation, GPU kind) from the default device, which is the CPU otherwise."""
        import jax

        return jax.default_device(self.devices[0])


def tpu_target(topology: str) -> Target:
    """Compile-only TPU devices of ``topology`` (``"v5e:2x2"``, ``"v6e:4x4"``, ``"v5p:2x2x1"``,
    ``"v4:2x2x1"``; libtpu's names).

    Raises:
      ValueError: a malformed topology name, or libtpu (``jax[tpu]``) missing.
    """
    if not _TPU_TOPOLOGY.match(topology):
        raise ValueError(f"topology: {topology!r} is not a TPU topology such as 'v5e:2x2', "
                         "'v6e:4x4' or 'v5p:2x2x1'")
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise ValueError("topology: compiling for TPU needs libtpu: pip install "
                         "'jax[tpu]' (in its own virtualenv; scripts/aot_env.sh tpu)") from e
    from jax.experimental import topologies

    # Compile-only: several processes may load libtpu at once (no chip is opened).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:  # noqa: BLE001 (libtpu's own refusal of the name)
        raise ValueError(f"topology: libtpu refuses {topology!r}: "
                         f"{str(e).splitlines()[0]}") from e
    chip = topology.split(":")[0].split("-")[0]
    return Target(topology, "tpu", tuple(desc.devices), chip, HBM_BYTES_PER_CHIP[chip])


def gpu_target_names() -> tuple[str, ...]:
    """The GPU targets kept in ``gpu_targets/`` (``("h100", "h200")``), sorted."""
    return tuple(sorted(f[:-len(".txtpb")] for f in os.listdir(GPU_TARGETS_DIR)
                        if f.endswith(".txtpb")))


def gpu_environment() -> dict[str, str]:
    """Set (in ``os.environ``) and return the variables that let the CUDA plugin compile with
    no GPU and no driver: ``CUDA_VISIBLE_DEVICES=-1`` (the plugin finds no device, so JAX keeps
    the CPU as its default backend) and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (no driver to
    check the CUDA libraries against). Variables already set are left as they are; on a host
    with GPUs, set ``CUDA_VISIBLE_DEVICES`` yourself to keep them visible to this process.

    Call it before the first JAX computation: the plugin reads them when the backends start.
    """
    env = {"CUDA_VISIBLE_DEVICES": "-1", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in env}


def cuda_plugin_missing() -> str | None:
    """Why the CUDA PJRT plugin cannot be used here, or None when it can."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        try:
            import jax_plugins.xla_cuda13  # noqa: F401
        except ImportError:
            return ("bash scripts/aot_env.sh cuda, or pip install 'jax[cuda12]' in its own "
                    "virtualenv (no GPU or driver is "
                    "needed to compile)")
    return None


def gpu_target(name: str, num_gpus: int = 8) -> Target:
    """Compile-only NVIDIA devices from the target config ``gpu_targets/<name>.txtpb``.

    ``name``: ``"h100"`` or ``"h200"`` (any file in ``gpu_targets/``, case-insensitive).
    ``num_gpus``: GPUs of the one host they sit in (1-8; default 8, an HGX node), so a mesh of
    ``tp * dp <= num_gpus`` devices can be built from ``Target.devices``. XLA, Triton and ptxas
    then compile for that GPU on the CPU (``jax.jit(f).trace(...).lower().compile()`` with
    inputs sharded over those devices; ``memory_analysis()`` gives per-GPU bytes). Sets
    ``gpu_environment()`` first.

    Raises:
      ValueError: ``gpu``: an unknown name (the known ones listed) or the CUDA plugin
        (``jax[cuda12]``) missing; ``num_gpus`` outside 1-8.
    """
    known = gpu_target_names()
    key = name.strip().lower()
    if key not in known:
        raise ValueError(f"gpu: unknown GPU target {name!r}; known targets: {', '.join(known)} "
                         f"(text protos in {GPU_TARGETS_DIR})")
    if not isinstance(num_gpus, int) or not 1 <= num_gpus <= 8:
        raise ValueError(f"num_gpus must be an int in [1, 8], got {num_gpus!r}")
    gpu_environment()
    missing = cuda_plugin_missing()
    if missing is not None:
        raise ValueError(f"gpu: compiling for {key} needs the CUDA plugin: {missing}")
    with open(os.path.join(GPU_TARGETS_DIR, key + ".txtpb")) as f:
        target_config = f.read()
    from jax.experimental import topologies

    # topology "slices x hosts x gpus per host": one host holding num_gpus GPUs.
    desc = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                        topology=f"1x1x{num_gpus}")
    # HBM as the target config says the driver reports it (the spec sheet's 141 GB is more).
    memory = re.search(r"device_memory_size:\s*(\d+)", target_config)
    hbm = int(memory.group(1)) if memory else HBM_BYTES_PER_CHIP[key]
    return Target(key, "gpu", tuple(desc.devices), key, hbm)


def resolve_target(topology: str | None = None, gpu: str | None = None) -> Target:
    """The ``Target`` of ``--topology`` or ``--gpu`` (exactly one); ``ValueError`` otherwise."""
    if (topology is None) == (gpu is None):
        raise ValueError("give exactly one of topology (a TPU topology) or gpu (h100, h200)")
    return tpu_target(topology) if topology is not None else gpu_target(gpu)
