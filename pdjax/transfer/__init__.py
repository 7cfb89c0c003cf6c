"""PD disaggregation (DESIGN.md §4): the prefill and decode roles, their ZMQ channel, the
transfer engines and the KV export. The control messages, their checks, the room records and
the bootstrap are the pure ``pdjax.pd`` package below it.

Submodules are imported explicitly; only ``kv_export`` works on JAX arrays, and none of them
imports JAX at module level.
"""
