"""The pure pieces of PD disaggregation (DESIGN.md §4): what the prefill and decode roles say to
each other and the state they keep about it, with no engine, no JAX and no data plane.

``protocol`` (the typed, versioned control messages), ``wire`` (their limits and field
checks), ``kv_buffers`` (``KVBufferDesc``, a KV buffer as the messages describe it),
``frame_auth`` (HMAC sealing of control frames), ``lifecycle`` (``KVPoll`` and ``PeerState``
with their checked transitions, the typed ``RoomFailure`` classes), ``rooms`` (the per-room and per-peer records) and
``bootstrap`` (the prefill's HTTP directory of its ranks, and its client). The roles that drive
them, their sockets and the KV copies live in ``pdjax.transfer``.
"""
