"""The pure pieces of PD disaggregation (DESIGN.md §4): what the prefill and decode roles say to
each other and the state they keep about it, with no engine, no JAX and no data plane.

``protocol`` (the typed, versioned control messages and ``KVPoll``), ``wire`` (their limits and
field checks), ``frame_auth`` (HMAC sealing of control frames), ``lifecycle`` (``PeerState``
and the typed ``RoomFailure`` classes), ``rooms`` (the per-room and per-peer records) and
``bootstrap`` (the prefill's HTTP directory of its ranks, and its client). The roles that drive
them, their sockets and the KV copies live in ``pdjax.transfer``.
"""
