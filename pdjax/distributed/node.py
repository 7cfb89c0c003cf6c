"""Multi-host SPMD serving (DESIGN.md §6): one process per host, one mesh over every process's
devices, the same jitted calls in the same order on every process.

Node 0 (the leader) runs the HTTP server, tokenizer, scheduler and engine; its ``ModelRunner``
is wrapped in ``LeaderRunner``, which sends every device-state call (warm-up, forward, resample,
prompt logprobs, penalty slot) to the followers as a ``wire`` message before making it. A follower
(``follow``) builds the same runner and makes the calls it receives, in order, so every
process enters each collective of each step together; it serves no HTTP and never reads a
result (the sampled ids are replicated: only the leader fetches them).

Sockets, all from ``--dist-init-addr HOST:PORT``: PORT is JAX's coordinator
(``jax.distributed.initialize``; on CPU the collectives run through gloo), PORT+1 the leader's
step socket (ZMQ ROUTER, one DEALER per follower: hello/welcome, then the calls), PORT+2 the
heartbeat socket (each follower sends one every ``min(1, dist_timeout_s / 5)`` s from its own
thread, and node 0's heartbeat thread answers each).
A follower that hears nothing from the leader for ``dist_timeout_s`` s logs that the leader
went away and exits 1; a leader that hears nothing from a follower marks itself unhealthy and
fails its in-flight requests (``Cluster.on_lost``). A collective whose peer died fails at once
(gloo: connection closed), and ``jax_enable_recoverability`` keeps JAX's coordination service
from aborting the survivors (node 0; a follower's worker is aborted when node 0's coordinator
goes, see ``pdjax.entrypoints.multihost``). JAX's preemption service is off: it would take
SIGTERM, which the server's drain needs. Start-up fails with a ``RuntimeError`` naming every
field where a node's model config, weights (``wire.weights_fingerprint``: file names, sizes and
sampled bytes), pdjax version or shape-fixing flags (``wire.AGREED_FIELDS``) differ from node
0's.
"""

from __future__ import annotations

import dataclasses
import logging
from os import _exit as hard_exit      # documented stdlib API: exit without cleanup
import threading
import time

import numpy as np

from pdjax.distributed import wire

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 120.0
KEPT_STEPS = 8            # calls whose outputs a later call may name (overlap needs 2)
_cluster = None
_welcomed = False          # a follower passed the start-up check (node 0 was up then)


def pdjax_version() -> str:
    try:
        from importlib.metadata import version

        return version("pdjax")
    except Exception:
        return "0.0.0"


def welcomed() -> bool:
    """Whether this follower passed node 0's start-up check (so node 0 was up)."""
    return _welcomed


def join(args) -> "Cluster | None":
    """This process's ``Cluster`` (JAX's distributed runtime started, the nodes checked against
    each other), made on the first call; None when ``args.nnodes == 1``."""
    global _cluster
    if args.nnodes == 1:
        return None
    if _cluster is None:
        _cluster = Cluster(args)
    return _cluster


def endpoints(addr: str) -> tuple[str, int]:
    """``(host, port)`` of ``--dist-init-addr HOST:PORT`` (already validated by ServerArgs)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class NodesDisagree(RuntimeError):
    """Start-up refused: a node's identity differs from node 0's (the text names each field)."""


class Cluster:
    """The nodes of one multi-host server, seen from one of them (``is_leader``: node 0)."""

    def __init__(self, args):
        import jax
        import zmq

        from pdjax.models.loader import checkpoint_config, resolve_model_path

        self.args = args
        self.rank = args.node_rank
        self.is_leader = self.rank == 0
        self.timeout_s = float(args.dist_timeout_s)
        self.lost: str | None = None      # why the cluster is broken, once it is
        self.on_lost = None               # leader: callback(reason), set by the engine
        host, port = endpoints(args.dist_init_addr)
        self.host, self.port = host, port
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_enable_recoverability", True)
        # JAX's preemption service takes SIGTERM for itself; the server's drain needs it.
        jax.config.update("jax_enable_preemption_service", False)
        logger.info("node %d/%d: joining JAX's distributed runtime at %s:%d", self.rank,
                    args.nnodes, host, port)
        jax.distributed.initialize(f"{host}:{port}", args.nnodes, self.rank,
                                   heartbeat_timeout_seconds=max(60, int(6 * self.timeout_s)))
        model_dir = resolve_model_path(args.model_path, args.revision)
        self.identity = wire.node_identity(args, wire.config_digest(checkpoint_config(model_dir)),
                                           pdjax_version(), wire.weights_fingerprint(model_dir))
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        if self.is_leader:
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 1000)
            # A call must never be dropped (the nodes would fall out of step): no queue limit,
            # and a send to a follower that is gone raises instead of vanishing.
            self._sock.setsockopt(zmq.SNDHWM, 0)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.bind(f"tcp://*:{port + 1}")
            self._followers = self._accept()
        else:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.IDENTITY, f"node-{self.rank}".encode())
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, 0)
            self._sock.connect(f"tcp://{host}:{port + 1}")
            self._hello()
        if args.tp_size != jax.device_count():     # after the check: all nodes agree on it
            raise ValueError(f"tp_size ({args.tp_size}) must equal the devices of all "
                             f"{args.nnodes} nodes ({jax.device_count()}) when nnodes > 1")
        self._hb = threading.Thread(target=self._heartbeats, name="pdjax-node-heartbeat",
                                    daemon=True)
        self._hb.start()

    # ------------------------------------------------------------------ start-up
    def _accept(self) -> list[bytes]:
        """Leader: one hello per follower, checked against node 0; all welcomed or all refused."""
        hellos: dict[int, tuple[bytes, dict]] = {}
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while len(hellos) < self.args.nnodes - 1:
            left_ms = max(1, int(1000 * (deadline - time.monotonic())))
            if not self._sock.poll(left_ms):
                missing = sorted(set(range(1, self.args.nnodes)) - set(hellos))
                raise RuntimeError(f"multi-host start-up: nodes {missing} did not say hello "
                                   f"within {HANDSHAKE_TIMEOUT_S:.0f} s")
            ident, frame = self._sock.recv_multipart()[:2]
            try:
                msg = wire.decode(frame)
                if msg["op"] != "hello":
                    raise wire.WireError(f"expected hello, got {msg['op']}")
                rank = wire.get_int(msg, "node_rank", 1, self.args.nnodes)
            except wire.WireError as e:
                logger.error("multi-host start-up: refused a frame: %s", e)
                continue
            hellos[rank] = (ident, msg)
        problems = [p for _, (_, msg) in sorted(hellos.items())
                    for p in wire.identity_mismatches(self.identity, msg)]
        for ident, _ in hellos.values():
            reply = (wire.encode("refuse", reason="; ".join(problems)) if problems
                     else wire.encode("welcome"))
            self._sock.send_multipart([ident, reply])
        if problems:
            raise NodesDisagree("multi-host start-up: the nodes disagree: " + "; ".join(problems))
        logger.info("node 0: %d followers joined", len(hellos))
        return [ident for _, (ident, _) in sorted(hellos.items())]

    def _hello(self) -> None:
        self._sock.send(wire.encode("hello", **self.identity))
        if not self._sock.poll(int(1000 * HANDSHAKE_TIMEOUT_S)):
            raise RuntimeError(f"multi-host start-up: node 0 at {self.host}:{self.port + 1} did "
                               f"not answer within {HANDSHAKE_TIMEOUT_S:.0f} s")
        msg = wire.decode(self._sock.recv())
        if msg["op"] == "refuse":
            raise NodesDisagree(f"multi-host start-up: the nodes disagree: {msg.get('reason')}")
        if msg["op"] != "welcome":
            raise RuntimeError(f"multi-host start-up: expected welcome, got {msg['op']}")
        global _welcomed
        _welcomed = True

    # ------------------------------------------------------------------ liveness
    def _heartbeats(self) -> None:
        import zmq

        sock = self._ctx.socket(zmq.ROUTER if self.is_leader else zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.is_leader:
            sock.bind(f"tcp://*:{self.port + 2}")
        else:
            sock.setsockopt(zmq.IDENTITY, f"node-{self.rank}".encode())
            sock.connect(f"tcp://{self.host}:{self.port + 2}")
        interval = min(1.0, self.timeout_s / 5)
        start = time.monotonic()
        seen = {r: start for r in range(1, self.args.nnodes)} if self.is_leader else {0: start}
        next_send = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if not self.is_leader and now >= next_send:
                sock.send(wire.encode("heartbeat", node_rank=self.rank))
                next_send = now + interval
            if sock.poll(int(1000 * interval / 2)):
                frames = sock.recv_multipart()
                try:
                    msg = wire.decode(frames[-1])
                    rank = wire.get_int(msg, "node_rank", 0, self.args.nnodes)
                except wire.WireError as e:
                    logger.error("heartbeat socket: refused a frame: %s", e)
                    continue
                seen[rank] = time.monotonic()
                if self.is_leader:       # answer each follower's heartbeat
                    sock.send_multipart([frames[0], wire.encode("heartbeat", node_rank=0)])
            for rank, t in seen.items():
                if time.monotonic() - t > self.timeout_s:
                    self._on_silent(rank, time.monotonic() - t)
                    if not self.is_leader:
                        return
                    seen[rank] = float("inf")      # reported once
        sock.close()

    def _on_silent(self, rank: int, silent_s: float) -> None:
        if not self.is_leader:
            exit_now(1, f"node {self.rank}: the leader (node 0 at {self.host}:{self.port}) went "
                     f"away: no heartbeat for {silent_s:.1f} s; exiting")
        reason = f"multi-host: node {rank} went away (no heartbeat for {silent_s:.1f} s)"
        logger.error("%s; this server is unhealthy", reason)
        if self.lost is None:
            self.lost = reason
            if self.on_lost is not None:
                self.on_lost(reason)

    # ------------------------------------------------------------------ leader
    def send(self, op: str, **fields) -> None:
        """Leader: send one call to every follower (engine thread only)."""
        import zmq

        frame = wire.encode(op, **fields)
        for ident in self._followers:
            try:
                self._sock.send_multipart([ident, frame])
            except zmq.ZMQError as e:
                raise RuntimeError(f"multi-host: cannot reach {ident.decode()} ({e})") from None

    def mirror(self, runner):
        """The runner the engine uses: ``LeaderRunner(runner)`` on node 0, ``runner`` itself on
        a follower (which drives it from ``follow``). Warm-up waits at ``barrier`` between
        compiling and running: gloo gives up on a collective whose peers are 30 s late, and one
        node may compile for longer than that (a persistent-cache miss)."""
        runner.warmup_barrier = self.barrier
        held, total = local_param_share(runner.state)
        logger.info("node %d holds %d of the %d parameter elements (%.1f%%): its own shards",
                    self.rank, held, total, 100.0 * held / max(total, 1))
        return LeaderRunner(runner, self) if self.is_leader else runner

    def barrier(self, timeout_s: float = 1800.0) -> None:
        """Every node waits here until all have arrived (over the step socket: followers say
        so, node 0 answers once all have). ``RuntimeError`` after ``timeout_s``."""
        if not self.is_leader:
            self._sock.send(wire.encode("barrier", node_rank=self.rank))
            if not self._sock.poll(int(1000 * timeout_s)):
                raise RuntimeError(f"node {self.rank}: node 0 did not pass the barrier in "
                                   f"{timeout_s:.0f} s")
            msg = wire.decode(self._sock.recv())
            if msg["op"] != "barrier":
                raise wire.WireError(f"expected barrier, got {msg['op']}")
            return
        arrived: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(arrived) < self.args.nnodes - 1:
            if self.lost is not None:
                raise RuntimeError(self.lost)
            if time.monotonic() > deadline:
                late = sorted(set(range(1, self.args.nnodes)) - arrived)
                raise RuntimeError(f"multi-host: nodes {late} did not reach the barrier in "
                                   f"{timeout_s:.0f} s")
            if self._sock.poll(500):
                _, frame = self._sock.recv_multipart()[:2]
                try:
                    msg = wire.decode(frame)
                    if msg["op"] == "barrier":
                        arrived.add(wire.get_int(msg, "node_rank", 1, self.args.nnodes))
                except wire.WireError as e:
                    logger.error("step socket: refused a frame: %s", e)
        self.send("barrier")

    def close(self) -> None:
        """Leader: tell the followers to exit (SIGTERM drain done); stop the heartbeats."""
        if self.is_leader and self.lost is None:
            try:
                self.send("shutdown")
            except RuntimeError as e:
                logger.warning("%s: not told to shut down", e)
        self._stop.set()

    # ------------------------------------------------------------------ follower
    def follow(self, runner, handlers=None) -> None:
        """Follower: make the leader's calls on ``runner`` until it says shutdown (exit 0) or
        goes away; a malformed message or a failed call exits 1 (the step sequence is broken,
        so the leader must see this node gone). ``handlers``: op -> callable(msg) for the
        messages that are not runner calls (a multi-host prefill's ``kv_peer`` / ``kv_write``,
        ``transfer/prefill_ranks.py``), made in step order; they report their own errors. Never
        returns."""
        mirror = FollowerCalls(runner)
        handlers = handlers or {}
        while True:
            try:
                msg = wire.decode(self._sock.recv())
            except wire.WireError as e:
                exit_now(1, f"node {self.rank}: refused a malformed message from the leader "
                            f"({e}); exiting")
            if msg["op"] == "shutdown":
                exit_now(0, f"node {self.rank}: the leader shut down; exiting")
            try:
                handler = handlers.get(msg["op"])
                if handler is not None:
                    handler(msg)
                    continue
                mirror.call(msg)
            except wire.WireError as e:
                exit_now(1, f"node {self.rank}: refused the leader's {msg['op']} ({e}); exiting")
            except Exception as e:
                exit_now(1, f"node {self.rank}: {msg['op']} failed ({type(e).__name__}: {e}); "
                            "a node probably went away; exiting")


def local_param_share(state) -> tuple[int, int]:
    """``(elements this process's devices hold, elements of the model)`` over every parameter
    of ``state`` (an NNX state), each distinct shard counted once: a parameter split over all
    nodes' devices counts its local part, a replicated one all of it."""
    import jax

    held = total = 0
    for leaf in jax.tree.leaves(state):
        if not isinstance(leaf, jax.Array):
            continue
        total += leaf.size
        seen = set()
        for shard in leaf.addressable_shards:
            key = tuple((i.start, i.stop) for i in shard.index)
            if key not in seen:
                seen.add(key)
                held += shard.data.size
    return held, total


def exit_now(code: int, message: str) -> None:
    """Log ``message`` and leave the process at once: no JAX shutdown barrier with a node
    that is gone."""
    (logger.info if code == 0 else logger.error)(message)
    print(f"pdjax: {message}", flush=True)
    logging.shutdown()
    hard_exit(code)


def _named(sampling) -> dict:
    """``SamplingInputs`` (a NamedTuple) as ``{field: value}``."""
    return dict(zip(type(sampling).__annotations__, sampling))


def _array_fields(obj) -> dict[str, np.ndarray]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), np.ndarray)}


class LeaderRunner:
    """Node 0's ``ModelRunner``: each call that touches device state goes to the followers
    first, then runs here; every other attribute is the runner's own. Device arrays a call
    takes (the previous step's tokens, a forward's hidden states) travel as the sequence
    number of the forward that made them."""

    def __init__(self, runner, cluster: Cluster):
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_cluster", cluster)
        object.__setattr__(self, "_seq", 0)
        object.__setattr__(self, "_made", {})     # id(device array) -> (seq, array)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __setattr__(self, name, value):
        setattr(self._runner, name, value)

    def _seq_of(self, array) -> int:
        if array is None:
            return -1
        entry = self._made.get(id(array))
        if entry is None or entry[1] is not array:
            raise RuntimeError("multi-host: a device array the followers do not know was passed "
                               "to the runner")
        return entry[0]

    def _remember(self, seq: int, *made) -> None:
        """Name ``seq`` for the device arrays a call made (a ``StepOutputs``' tokens and the
        ``StepOutputs`` itself, hidden states, logits)."""
        for a in made:
            if a is None:
                continue
            tokens = getattr(a, "tokens", None)
            for x in (a,) if tokens is None else (a, tokens):
                self._made[id(x)] = (seq, x)
        for key in [k for k, (s, _) in self._made.items() if s <= seq - KEPT_STEPS]:
            del self._made[key]

    def _next_seq(self) -> int:
        seq = self._seq + 1
        object.__setattr__(self, "_seq", seq)
        return seq

    def warmup(self, progress: bool = True, compile_threads: int | None = None,
               split_sampling: bool = False, core_only: bool = False) -> float:
        if core_only:       # a background compile's first runs would be this node's alone
            raise ValueError("core_only warm-up (background compiles) is not for multi-host")
        self._cluster.send("warmup", split_sampling=bool(split_sampling))
        return self._runner.warmup(progress=progress, compile_threads=compile_threads,
                                   split_sampling=split_sampling)

    def forward(self, key, fb, sampling=None, prev_idx=None, prev_tokens=None,
                want_hidden: bool = False, want_logits: bool = False):
        from pdjax.runner import device_sampler

        r = self._runner
        if sampling is None:
            sampling = device_sampler.build_sampling_inputs([], r.logits_rows(key),
                                                            vocab_size=r.cfg.vocab_size)
        if prev_idx is None:
            prev_idx = np.full(key.num_tokens, -1, np.int32)
        seq = self._next_seq()
        self._cluster.send(
            "forward", seq=seq, key=[key.entry, key.num_tokens, key.num_rows, key.pages_per_seq],
            batch={k: wire.encode_array(a) for k, a in _array_fields(fb).items()},
            sampling={k: wire.encode_array(np.asarray(v)) for k, v in _named(sampling).items()},
            prev_idx=wire.encode_array(prev_idx), prev=self._seq_of(prev_tokens),
            want_hidden=bool(want_hidden), want_logits=bool(want_logits))
        result = r.forward(key, fb, sampling, prev_idx, prev_tokens, want_hidden, want_logits)
        self._remember(seq, *result)
        return result

    def resample(self, entry: str, logits, sampling, first, redo):
        seq = self._next_seq()
        self._cluster.send(
            "resample", seq=seq, entry=str(entry), logits=self._seq_of(logits),
            first=self._seq_of(first.tokens),
            sampling={k: wire.encode_array(np.asarray(v)) for k, v in _named(sampling).items()},
            redo=wire.encode_array(np.asarray(redo, bool)))
        out = self._runner.resample(entry, logits, sampling, first, redo)
        self._remember(seq, out)
        return out

    def prompt_logprobs_at(self, hidden, indices, target_ids, want_top: bool):
        self._cluster.send("prompt_logprobs", hidden=self._seq_of(hidden),
                           indices=[int(i) for i in indices],
                           target_ids=[int(t) for t in target_ids], want_top=bool(want_top))
        return self._runner.prompt_logprobs_at(hidden, indices, target_ids, want_top)

    def init_penalty_slot(self, slot: int, prompt_ids, output_ids) -> None:
        self._cluster.send("penalty_slot", slot=int(slot), prompt_ids=[int(t) for t in prompt_ids],
                           output_ids=[int(t) for t in output_ids])
        self._runner.init_penalty_slot(slot, prompt_ids, output_ids)


class FollowerCalls:
    """A follower's side of ``LeaderRunner``: every message range-checked against this
    runner's buckets, pages and vocabulary before the call is made (``WireError`` if not)."""

    def __init__(self, runner):
        from pdjax.runner import device_sampler

        self.runner = runner
        self.keys = {(k.entry, k.num_tokens, k.num_rows, k.pages_per_seq): k
                     for k in runner.buckets.all_keys()}
        self._sampler = device_sampler
        self._made: dict[int, dict] = {}           # seq -> {"out", "hidden", "logits"}
        self._last_seq = 0

    def _arrays(self, msg: dict, name: str, template: dict[str, np.ndarray]) -> dict:
        got = msg.get(name)
        if not isinstance(got, dict) or set(got) != set(template):
            raise wire.WireError(f"{name}: expected fields {sorted(template)}")
        out = {}
        for k, want in template.items():
            a = wire.decode_array(got[k], f"{name}.{k}")
            if a.dtype != np.asarray(want).dtype or a.shape != np.shape(want):
                raise wire.WireError(f"{name}.{k}: {a.dtype}{list(a.shape)}, expected "
                                     f"{np.asarray(want).dtype}{list(np.shape(want))}")
            out[k] = a
        return out

    @staticmethod
    def _in_range(name: str, a: np.ndarray, lo: int, hi: int) -> None:
        if a.size and (a.min() < lo or a.max() >= hi):
            raise wire.WireError(f"{name}: values outside [{lo}, {hi})")

    def _made_by(self, seq: int, which: str):
        if self._made.get(seq, {}).get(which) is None:
            raise wire.WireError(f"step {seq} is not one of the kept forwards (no {which})")
        return self._made[seq][which]

    def _keep(self, seq: int, **made) -> None:
        self._made[seq] = made
        self._made.pop(seq - KEPT_STEPS, None)
        self._last_seq = seq

    def _sampling(self, msg: dict, rows: int):
        r = self.runner
        template = self._sampler.build_sampling_inputs([], rows, vocab_size=r.cfg.vocab_size)
        samp = self._arrays(msg, "sampling", _named(template))
        self._in_range("sampling.penalty_slot", samp["penalty_slot"], 0, r.num_penalty_slots)
        if "logit_bias_ids" in samp:
            self._in_range("sampling.logit_bias_ids", samp["logit_bias_ids"], 0,
                           r.cfg.vocab_size)
        if "held_stop_ids" in samp:
            self._in_range("sampling.held_stop_ids", samp["held_stop_ids"], -1,
                           r.cfg.vocab_size)
        return self._sampler.SamplingInputs(**samp)

    def call(self, msg: dict) -> None:
        op, r = msg["op"], self.runner
        vocab = r.cfg.vocab_size
        if op == "warmup":
            r.warmup(progress=False, split_sampling=bool(msg.get("split_sampling")))
        elif op == "forward":
            self._forward(msg)
        elif op == "resample":
            self._resample(msg)
        elif op == "prompt_logprobs":
            hidden = self._made_by(wire.get_int(msg, "hidden", 1, self._last_seq + 1), "hidden")
            n = hidden.shape[0]
            indices = wire.get_int_list(msg, "indices", 0, n, n)
            targets = wire.get_int_list(msg, "target_ids", 0, vocab, n)
            r.prompt_logprobs_at(hidden, indices, targets, bool(msg.get("want_top")))
        elif op == "penalty_slot":
            slot = wire.get_int(msg, "slot", 0, r.num_penalty_slots)
            limit = r.page_size * r.num_pages
            r.init_penalty_slot(slot, wire.get_int_list(msg, "prompt_ids", 0, vocab, limit),
                                wire.get_int_list(msg, "output_ids", 0, vocab, limit))
        else:
            raise wire.WireError(f"op {op!r} is not a runner call")

    def _forward(self, msg: dict) -> None:
        r = self.runner
        seq = wire.get_int(msg, "seq", self._last_seq + 1, self._last_seq + 2)
        raw_key = msg.get("key")
        key = self.keys.get(tuple(raw_key)) if isinstance(raw_key, list) else None
        if key is None:
            raise wire.WireError(f"key: {raw_key!r} is not a warmed-up bucket")
        template = r.make_batch(key, [])
        fields = self._arrays(msg, "batch", _array_fields(template))
        T, slots = key.num_tokens, r.num_pages * r.page_size
        prev_idx = wire.decode_array(msg.get("prev_idx"), "prev_idx")
        if prev_idx.dtype != np.int32 or prev_idx.shape != (T,):
            raise wire.WireError(f"prev_idx: expected int32[{T}]")
        self._in_range("prev_idx", prev_idx, -1, r.max_logits_rows)
        # A token the previous step samples (prev_idx >= 0) is a placeholder id here.
        self._in_range("batch.input_ids", fields["input_ids"][prev_idx < 0], 0, r.cfg.vocab_size)
        context = key.pages_per_seq * r.page_size
        for name, hi in (("positions", context),
                         ("slot_mapping", slots), ("cu_q_lens", T + 1), ("kv_lens", context + 1),
                         ("page_indices", r.num_pages), ("distribution", key.num_rows + 1),
                         ("logits_indices", T)):
            self._in_range(f"batch.{name}", fields[name], 0, hi)
        fb = dataclasses.replace(template, **fields)
        sampling = self._sampling(msg, r.logits_rows(key))
        prev = wire.get_int(msg, "prev", -1, seq)
        prev_tokens = None if prev == -1 else self._made_by(prev, "out").tokens
        want_logits = bool(msg.get("want_logits"))
        result = r.forward(key, fb, sampling, prev_idx, prev_tokens, bool(msg.get("want_hidden")),
                           want_logits)
        self._keep(seq, out=result[0], hidden=result[1],
                   logits=result[2] if want_logits else None)

    def _resample(self, msg: dict) -> None:
        seq = wire.get_int(msg, "seq", self._last_seq + 1, self._last_seq + 2)
        entry = msg.get("entry")
        if entry not in {k.entry for k in self.keys.values()}:
            raise wire.WireError(f"entry: {entry!r} is not an entry point")
        logits = self._made_by(wire.get_int(msg, "logits", 1, seq), "logits")
        first = self._made_by(wire.get_int(msg, "first", 1, seq), "out")
        rows = logits.shape[0]
        sampling = self._sampling(msg, rows)
        redo = wire.decode_array(msg.get("redo"), "redo")
        if redo.dtype != np.bool_ or redo.shape != (rows,):
            raise wire.WireError(f"redo: expected bool[{rows}]")
        self._keep(seq, out=self.runner.resample(entry, logits, sampling, first, redo))
