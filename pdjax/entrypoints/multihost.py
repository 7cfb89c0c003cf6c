"""A multi-host follower process (``python -m pdjax.serve --nnodes N --node-rank R``, R > 0;
DESIGN.md §6): a supervisor and its worker.

The worker joins the cluster, builds the runner as node 0's engine does
(``pdjax.engine.runner_setup.build_runner``; no engine, scheduler or tokenizer) and follows node 0
(``pdjax.distributed.Cluster.follow``) until it shuts down or goes away; a prefill node also
registers and writes its own KV shards (``pdjax.transfer.prefill_ranks.RankSender``), a decode node
reports its own to node 0 for the prefill to write (``pdjax.transfer.decode_ranks.DecodeRankNode``).
The supervisor exists because JAX's coordination client aborts the worker (SIGABRT) as soon as node 0's coordinator
is gone, before the heartbeat can say so: the supervisor then reports that the leader went
away (its heartbeat port no longer answers) and exits 1. Signals to the supervisor reach the
worker; the worker dies with the supervisor (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket

from pdjax.distributed.node import NodesDisagree, endpoints, exit_now, join, welcomed

logger = logging.getLogger(__name__)


def run_follower(args) -> int:
    """Fork the worker, wait for it, and return its exit status (1 when a signal ended it)."""
    pid = os.fork()
    if pid == 0:
        _die_with_parent()
        _work(args)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return code                     # the worker said why itself
    host, port = endpoints(args.dist_init_addr)
    if not _port_open(host, port + 2):
        exit_now(1, f"node {args.node_rank}: the leader (node 0 at {host}:{port}) went away: "
                    f"its heartbeat port is closed and JAX stopped this node's worker (signal "
                    f"{-code}); exiting")
    exit_now(1, f"node {args.node_rank}: the worker died of signal {-code}; exiting")
    return 1


def _work(args) -> None:
    from pdjax.engine.runner_setup import build_runner

    try:
        cluster = join(args)
        node = build_runner(args, progress=False)
        node.runner = cluster.mirror(node.runner)
    except NodesDisagree as e:
        exit_now(2, f"node {args.node_rank}: {e}")
    except Exception as e:
        host, port = endpoints(args.dist_init_addr)
        if welcomed() and not _port_open(host, port + 2):
            exit_now(1, f"node {args.node_rank}: the leader (node 0 at {host}:{port}) went away "
                        f"during start-up ({type(e).__name__}: {e}); exiting")
        exit_now(2, f"node {args.node_rank}: {type(e).__name__}: {e}")
    handlers = None
    if args.role in ("prefill", "decode"):     # this node's own KV shards (DESIGN.md §6)
        from pdjax.transfer.decode_ranks import DecodeRankNode
        from pdjax.transfer.prefill_ranks import RankSender

        try:
            handlers = (RankSender if args.role == "prefill"
                        else DecodeRankNode).for_host(node).handlers
        except Exception as e:
            exit_now(2, f"node {args.node_rank}: cannot set up its KV transfers "
                        f"({type(e).__name__}: {e})")
    cluster.follow(node.runner, handlers)         # never returns


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        logger.warning("multi-host: PR_SET_PDEATHSIG unavailable; the worker may outlive its "
                       "supervisor")


def _port_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout_s):
            return True
    except OSError:
        return False
