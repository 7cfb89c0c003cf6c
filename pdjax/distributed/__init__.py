"""Multi-host SPMD serving (``--nnodes``, ``--node-rank``, ``--dist-init-addr``; DESIGN.md §6):
``node.py`` joins JAX's distributed runtime and mirrors node 0's runner calls to the other
nodes, ``wire.py`` is their message format (msgpack, no JAX). A follower process is started
by ``pdjax.entrypoints.multihost``."""

from pdjax.distributed.node import Cluster, LeaderRunner, join  # noqa: F401
