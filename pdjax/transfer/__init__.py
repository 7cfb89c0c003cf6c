"""PD disaggregation (DESIGN.md §4): control protocol, bootstrap, transfer engines, KV export.

Submodules are imported explicitly; only ``kv_export`` works on JAX arrays, and none of them
imports JAX at module level.
"""
