"""Deviceless ahead-of-time compilation: every executable of a server, compiled for a TPU
topology or an NVIDIA GPU target on a machine without either (DESIGN.md §7).

    python -m pdjax.aot --model-path pdjax/aot/configs/deepseek-v3.2 --topology v5p:4x4x4 \\
        --tp-size 64

``targets`` makes the compile-only devices, ``engine.AbstractEngine`` the executables from
shapes, ``report`` the per-entry table and the per-chip HBM budget, ``executables`` writes
them (``--serialize DIR``) for a server to load instead of compiling.
"""
