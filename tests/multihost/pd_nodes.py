"""Two-process PD servers for the multi-host PD tests (``test_pd_multihost.py`` over Mooncake,
``test_pd_multihost_jax.py`` over ``jax.experimental.transfer``): TP 2 over two processes on
127.0.0.1, one CPU device each, so each node holds one of the tiny Llama's two KV heads."""

from __future__ import annotations

import contextlib
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "transfer"))
from pd_harness import TINY_ARGS, Server, child_env, free_port, running  # noqa: E402


def node(role: str, model: str, rank: int, coord: int, http: int, logs: str, flags=(),
         **overrides) -> Server:
    """Node ``rank`` of a ``--role`` server over two processes (``--nnodes 2``, TP 2;
    coordinator at 127.0.0.1:``coord``, HTTP on ``http``: node 0's, 0 for node 1), with
    ``flags`` and the tiny models' settings (``TINY_ARGS``) updated by ``overrides``."""
    argv = [sys.executable, "-m", "pdjax.serve", "--role", role, "--model-path", model,
            "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr",
            f"127.0.0.1:{coord}", "--tp-size", "2", "--port", str(http),
            "--skip-warmup-progress", "--dist-timeout-s", "10", *flags]
    # Two decode-row buckets instead of four: the follower compiles every shape itself (the
    # persistent cache holds node 0's), the tests' longest wait.
    for k, v in {**TINY_ARGS, "max_running_requests": 2, **overrides}.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return Server(f"{role}_node{rank}", argv, http, logs, child_env())


@contextlib.contextmanager
def node_pair(node0: Server, node1: Server):
    """Node 0 healthy for the block (node 1 serves no HTTP); node 1's log is printed when
    the block fails, and it is stopped after."""
    try:
        with running([node0]):
            yield
    except BaseException:
        print(f"==== {node1.name} log ====\n{node1.log_tail(80)}")
        raise
    finally:
        node1.stop()


def decode_nodes(model: str, logs: str, flags=()):
    """A decode over two nodes with ``flags`` (the data plane's, the secret): yields
    ``SimpleNamespace(node0, node1)`` while node 0 is healthy (a fixture's body). It computes
    no prompt: one token bucket (16) is enough, one shape less to compile."""
    coord, http = free_port(), free_port()
    nodes = [node("decode", model, rank, coord, http if rank == 0 else 0, logs,
                  [*flags, "--num-reserved-decode-tokens", "16"], chunked_prefill_size=16)
             for rank in (0, 1)]
    with node_pair(*nodes):
        yield types.SimpleNamespace(node0=nodes[0], node1=nodes[1])
