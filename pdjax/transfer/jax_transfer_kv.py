"""This server's KV pool for the ``jax`` transfer backend (``jax.experimental.transfer``,
DESIGN.md §4, data plane): device programs and the arrays in flight, no transport.

The ``jax`` backend moves compact device arrays instead of writing into a peer's pages:

    prefill  ``stage_out(src)`` (engine thread, after the step that wrote the pages) gathers
             the pages ``src`` of every KV buffer into ``[layers, bucket, page_size, ...]``
             arrays (the runner's jitted ``gather_pages``; ``bucket``: the page count padded to
             a power of two, ``local_kv.page_buckets``, one executable per bucket, compiled in
             ``warmup``) and keeps them until the transfer thread takes them
             (``take_gathered``) to offer them to the decode.
    decode   the pulled arrays are put here (``put_arrived``, pull thread); ``stage_in(pages)``
             (engine thread, at the metadata gate, a step boundary: the seam the staging path
             uses) zeroes the padding rows (one jit per bucket) and scatters the rows into the
             pool with the runner's donated ``scatter_pages``; padding rows go to the null page
             0 as zeros, as ``LocalKV.stage_in`` does, so it stays clean.

``layout`` is a ``KVLayout`` like ``LocalKV``'s (the pairing checks and the page-count checks
of the control plane read it), but its shard addresses are placeholders: nothing writes into
this pool by address. ``offer_descriptor(bucket)`` is the layout descriptor an offer carries
(per buffer: name, shape, dtype, shard shapes, the KV head range of each shard, page size and
KV format); ``check_offer`` refuses one that differs from this pool's before any byte moves,
naming both sides.

Different TP sizes (``units_for``): a buffer with KV heads moves as ``U = max(tp_prefill,
tp_decode)`` head-group units, each a single-device array: the prefill cuts them from the
shard that holds those heads (``offer_units``), the decode pulls unit ``u`` onto its device
that holds them and concatenates each device's units into its shard (``assemble``); a buffer
without heads (MLA latent, indexer keys: replicated) is pulled once and copied to the other
decode devices. Heads that ``tp_model_config`` repeats (TP above the KV heads) move as
logical heads: ``U`` is then the checkpoint's KV heads, a unit is cut from one device holding a
copy and pulled once onto the first decode device holding one, then copied to the others.

Over several processes (``--nnodes > 1``, DESIGN.md §6) each process moves only its own
shards, paired by rank (``routes``): prefill node ``p`` offers decode node ``d`` the units that
``p``'s devices hold and ``d``'s devices need, under its own uuid (a buffer without heads comes
from prefill node ``d % P``); a decode node gathers the units of a chunk from every offer
(``put_units``) and assembles them at ``stage_in``; node 0 of a multi-host decode tells the
other nodes to scatter theirs at the same step boundary (``mirror``: ``kv_stage_in`` /
``kv_drop`` on the step socket, ``transfer/decode_ranks.py``). Every process runs the gather,
mask and scatter on its own shards only: none of them has a collective.

Shapes: KV buffers ``[layers, num_pages, page_size, *row]`` (GQA ``k_cache``/``v_cache``,
MLA ``latent`` and the DSA ``indexer_k``, FP8 records' planes); page ids int32.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Sequence

import numpy as np

from pdjax.models.cache_spec import kv_format
from pdjax.transfer.jax_transfer_layout import descriptor_layout, device_heads
from pdjax.transfer.jax_transfer_programs import pad_mask
from pdjax.transfer.kv_copies import KVLayout
from pdjax.transfer.kv_export import kv_layout_fingerprint
from pdjax.transfer.local_kv import page_buckets

logger = logging.getLogger(__name__)

STALE_S = 900.0          # gathered / pulled arrays nobody took are dropped after this long


@dataclasses.dataclass
class _Arrival:
    """Pulled rows of decode pages ``dst``: ``parts`` (compact arrays in the pool's sharding),
    or the ``units`` (``(buffer, unit) -> array``, ``bucket`` pages each) of ``counts`` units
    per buffer that the offers of a chunk brought so far (one per prefill node holding some).
    A chunk is ``(room, dst)``: ``room`` is the offers' ``bootstrap_room`` (0: none given), so
    a late offer of a failed room never joins a later room that reuses its pages."""

    dst: tuple[int, ...]
    parts: list[Any] | None
    t: float
    units: dict = dataclasses.field(default_factory=dict)
    counts: tuple[int, ...] = ()
    bucket: int = 0
    room: int = 0


class JaxLocalKV:
    """The runner's KV pool as the ``jax`` backend moves it (see the module docstring).

    Same surface as ``LocalKV`` (``layout``, ``fingerprint``, ``kv_dtype``, ``num_pages``,
    ``bytes_per_page``, ``num_layer_buffers``, ``check_addresses``, ``warmup``, ``stage_out``,
    ``stage_in``, ``close``; ``mode`` is ``"jax"``), plus ``take_gathered``/``drop_gathered``/
    ``routes``/``offer_units`` (prefill), ``offer_descriptor``/``check_offer``/``pull_specs``/
    ``put_units``/``put_arrived``/``drop_arrived`` (decode). ``layout`` and
    ``bytes_per_page`` are this process's shards (a multi-host node's own); descriptors and
    units are over every process's. ``engine``: the ``JaxTransferEngine`` (it is told about
    this pool: ``attach_kv``); ``head_repeat``: how often ``tp_model_config`` repeated each
    KV head. ``mirror(op, **fields)``: set on node 0 of a multi-host decode to send
    ``kv_stage_in`` / ``kv_drop`` to the other nodes (engine thread).
    """

    mode = "jax"

    def __init__(self, runner, engine, max_pages_per_seq: int = 64, head_repeat: int = 1):
        import jax

        arrays = runner.kv_buffers()
        self.runner, self.engine = runner, engine
        self.names = [s.name for s in runner.cache_specs]
        self.head_repeat = head_repeat
        self.row_heads = [s.row_heads for s in runner.cache_specs]
        self.fingerprint = kv_layout_fingerprint(arrays, head_repeat=head_repeat,
                                                 row_heads=self.row_heads)
        self.kv_dtype = kv_format(runner.cache_specs)
        self.num_pages = int(arrays[0].shape[1])
        self.page_size = int(arrays[0].shape[2])
        self.max_pages_per_seq = max(1, int(max_pages_per_seq))
        self.buckets = page_buckets(self.max_pages_per_seq)
        self.node_rank, self.num_nodes = jax.process_index(), jax.process_count()
        local_n = len(arrays[0].addressable_shards)
        self.layout = descriptor_layout(arrays, head_repeat, self.row_heads,
                                         self.node_rank * local_n)
        # What the descriptors and pull specs need, read once here: the pool arrays are
        # donated by every step, so other threads must never touch them.
        self._shapes = [tuple(map(int, a.shape)) for a in arrays]
        self._dtypes = [a.dtype for a in arrays]
        self._shardings = [runner.jits.cache_shardings[n] for n in self.names]
        # A buffer with KV heads (GQA's K and V) moves in head-group units; one without (an
        # MLA latent, the indexer keys) is one unit, replicated on every decode device.
        self._has_heads = [b.num_heads > 1 for b in self.layout.buffers]
        self._dev_heads, self._epu = [], []
        for arr, rh, has in zip(arrays, self.row_heads, self._has_heads):
            heads, epu = device_heads(arr, rh if has else None, head_repeat if has else 1)
            self._dev_heads.append(heads)
            self._epu.append(epu)
        # Per buffer the distinct head ranges over every process (repeated heads once): the
        # descriptor's shard_heads; and this process's devices, in head order.
        self._ranges = [sorted(set(h.values())) for h in self._dev_heads]
        self._local_devs = [[sh.device for sh in sorted(a.addressable_shards, key=lambda sh: (
            self._dev_heads[b][sh.device], sh.device.id))] for b, a in enumerate(arrays)]
        self.bytes_per_page = sum(b.num_layers * b.bytes_per_page * len(b.shard_addrs)
                                  for b in self.layout.buffers)
        self.num_address_changes = 0
        self.num_missing_arrivals = 0      # stage_in found no pulled rows for a page
        self.mirror = None
        self._lock = threading.Lock()
        self._gathered: dict[tuple[int, ...], collections.deque] = {}
        self._arrived: list[_Arrival] = []
        self._mask = None
        if hasattr(engine, "attach_kv"):
            engine.attach_kv(self)

    @property
    def num_layer_buffers(self) -> int:
        """Per-layer KV buffers of this process's shards (layers x shards, summed over the
        buffers), as ``LocalKV`` reports them (start-up log, the connector's state)."""
        return sum(b.num_layers * len(b.shard_addrs) for b in self.layout.buffers)

    def check_addresses(self) -> bool:
        """Never moves: nothing is registered by address."""
        return False

    # -- units -----------------------------------------------------------------------------
    def _logical_shape(self, b: int, bucket: int) -> list[int]:
        """Buffer ``b``'s compact ``bucket``-page shape, repeated heads counted once."""
        shape = self._shapes[b]
        rep = self.head_repeat if self._has_heads[b] else 1
        return [shape[0], int(bucket), shape[2], shape[3] // rep, *shape[4:]]

    def _unit_holders(self, b: int, units: int) -> list[list]:
        """Per unit of buffer ``b`` (``units`` of them), this process's devices holding it."""
        heads = self.layout.buffers[b].num_heads
        w = heads // units
        return [[d for d in self._local_devs[b]
                 if self._dev_heads[b][d][0] <= u * w
                 and (u + 1) * w <= sum(self._dev_heads[b][d])] for u in range(units)]

    def _unit_owners(self, b: int, units: int) -> list[int]:
        """Per unit of buffer ``b``, the lowest process index of a device holding it (copies
        of a head that TP repeats can span processes: one of them offers the unit)."""
        w = self.layout.buffers[b].num_heads // units
        return [min((self._process_of(d) for d, (a, c) in self._dev_heads[b].items()
                     if a <= u * w and (u + 1) * w <= a + c), default=-1) for u in range(units)]

    @staticmethod
    def _process_of(device) -> int:
        return device.process_index

    def units_for(self, peer_shards: Sequence[int]) -> list[int]:
        """Head-group units per buffer between this pool and a peer whose buffers have
        ``peer_shards`` distinct head ranges: ``max`` of the two sides' for a buffer with heads
        (each unit on one device of either side), 1 for a buffer without. ``ValueError``
        naming the buffer when the heads or either side's shards do not split into them."""
        out = []
        for b, (desc, theirs) in enumerate(zip(self.layout.buffers, peer_shards)):
            ours = len(self._ranges[b])
            if not self._has_heads[b]:
                out.append(1)
                continue
            u = max(ours, int(theirs))
            if desc.num_heads % u or u % ours or u % int(theirs):
                raise ValueError(f"kv_buffers[{b}] ({self.names[b]}): {desc.num_heads} KV "
                                 f"heads on {ours} shards here and {theirs} on the peer do "
                                 f"not split into {u} head-group units")
            out.append(u)
        return out

    def routes(self, layout: KVLayout, session_id: str, node_sessions: Sequence[str] = (),
               shard_nodes: Sequence[Sequence[int]] = ()) -> tuple[list[int], list[tuple]]:
        """Prefill: where this process's units of a chunk go for a decode of ``layout``
        (``session_id``; a multi-host decode's ``node_sessions`` and ``shard_nodes``).
        Returns ``(units per buffer, [(decode node, session, unit ids per buffer, bytes a
        page its shards receive)])`` per decode node, node 0 last: the units this process's
        devices hold that the node's shards need (a buffer without heads from prefill node
        ``d % P`` alone; a unit held by several processes from the lowest). Bytes are the
        decode's, as Mooncake counts them: a unit once per shard of the node holding it."""
        units = self.units_for([len(set(b.shard_heads)) for b in layout.buffers])
        sessions = list(node_sessions) or [session_id]
        owners = shard_nodes or [[0] * len(b.shard_heads) for b in layout.buffers]
        out = []
        for d in reversed(range(len(sessions))):
            which, per_page = [], 0
            for b, (desc, u_n) in enumerate(zip(layout.buffers, units)):
                w = desc.num_heads // u_n
                held = [desc.shard_heads[s] for s, n in enumerate(owners[b]) if n == d]
                need = [sum(1 for a, c in held if a <= u * w and (u + 1) * w <= a + c)
                        for u in range(u_n)]
                if self._has_heads[b]:       # a repeated head: its lowest process offers it
                    ids = [u for u, p in enumerate(self._unit_owners(b, u_n))
                           if need[u] and p == self.node_rank]
                else:
                    ids = [0] if need[0] and d % self.num_nodes == self.node_rank else []
                which.append(ids)
                per_page += sum(desc.num_layers * self.page_size * desc.head_bytes * w * need[u]
                                for u in ids)
            out.append((d, sessions[d], which, per_page))
        return units, out

    # -- descriptors -----------------------------------------------------------------------
    def offer_descriptor(self, bucket: int, units: Sequence[int] | None = None,
                         which: Sequence[Sequence[int]] | None = None) -> list[dict]:
        """Per buffer, what a compact ``bucket``-page array of this pool is and how it moves:
        ``name``, ``shape`` ``[layers, bucket, page_size, *row]`` (repeated heads once),
        ``dtype``, ``shard_heads`` (``[start, count]`` of checkpoint KV heads per distinct
        shard, over every process), ``num_heads``, ``page_size``, ``kv_format``, ``units``
        (head-group units, default: one per shard of a buffer with heads, else 1) with
        ``unit_shape`` (dimension 3 split ``units`` ways), and ``unit_ids`` (the units this
        offer carries; default all). JSON/msgpack-safe."""
        out = []
        for b, (name, dtype, desc) in enumerate(zip(self.names, self._dtypes,
                                                    self.layout.buffers)):
            shape = self._logical_shape(b, bucket)
            u = int(units[b]) if units is not None else (
                len(self._ranges[b]) if self._has_heads[b] else 1)
            ids = [int(x) for x in which[b]] if which is not None else list(range(u))
            unit_shape = [*shape[:3], shape[3] // u, *shape[4:]]
            out.append({"name": name, "shape": shape, "dtype": np.dtype(dtype).name,
                        "shard_heads": [list(h) for h in self._ranges[b]],
                        "num_heads": desc.num_heads, "page_size": self.page_size,
                        "kv_format": self.kv_dtype, "units": u, "unit_shape": unit_shape,
                        "unit_ids": ids})
        return out

    def check_offer(self, buffers: Any, dst: Sequence[int],
                    bucket: int) -> tuple[list[int], list[list[int]]]:
        """``(units, unit ids)`` per buffer of an offer whose descriptor is ``buffers`` (the
        prefill's ``offer_descriptor(bucket, units, which)``). ``ValueError`` naming the field
        and both sides when it does not describe this pool's buffers (name, shape, dtype,
        heads, page size, KV format, units), a unit id is repeated or held by no device of
        this process, ``bucket`` is not one this pool compiled for, or ``dst`` (the decode
        pages) does not fit ``[1, num_pages)`` and the bucket."""
        if bucket not in self.buckets:
            raise ValueError(f"bucket: the prefill's {bucket} pages is not a bucket of this "
                             f"decode ({self.buckets})")
        # Types first: len() or int() of a mistyped field would raise TypeError, which the
        # pull thread does not count as a refused offer.
        if not isinstance(dst, (list, tuple)) or not all(
                isinstance(p, int) and not isinstance(p, bool) for p in dst):
            raise ValueError("dst_pages: expected a list of page ids")
        if not 1 <= len(dst) <= bucket:
            raise ValueError(f"dst_pages: {len(dst)} pages for a {bucket}-page bucket")
        bad = [p for p in dst if not 1 <= p < self.num_pages]
        if bad:
            raise ValueError(f"dst_pages: {bad[:4]} outside [1, {self.num_pages})")
        if not isinstance(buffers, (list, tuple)) or not all(isinstance(d, dict)
                                                             for d in buffers):
            raise ValueError(f"layout descriptor: expected a list of buffer dicts, got "
                             f"{type(buffers).__name__}")
        if len(buffers) != len(self.names):
            raise ValueError(f"layout descriptor: prefill has {len(buffers)} KV buffers, "
                             f"decode {len(self.names)} ({self.names})")
        if not all(isinstance(d.get("shard_heads"), list) and d["shard_heads"]
                   for d in buffers):
            raise ValueError("layout descriptor: a buffer without a shard_heads list")
        theirs_shards = [len(d["shard_heads"]) for d in buffers]
        units = self.units_for(theirs_shards)
        ours = self.offer_descriptor(bucket, units)
        which = []
        for i, (theirs, mine) in enumerate(zip(buffers, ours)):
            for key in ("name", "shape", "dtype", "num_heads", "page_size", "kv_format",
                        "units", "unit_shape"):
                if theirs.get(key) != mine[key]:
                    raise ValueError(f"layout descriptor: buffers[{i}] ({mine['name']}) {key}: "
                                     f"prefill {theirs.get(key)!r} != decode {mine[key]!r}")
            if self._has_heads[i]:          # each prefill shard: an equal, ordered head range
                n, h = len(theirs["shard_heads"]), mine["num_heads"]
                want = [[k * h // n, h // n] for k in range(n)]
                if theirs["shard_heads"] != want:
                    raise ValueError(f"layout descriptor: buffers[{i}] ({mine['name']}) "
                                     f"shard_heads: prefill {theirs['shard_heads']!r}, decode "
                                     f"expects {want!r} for {n} shards")
            ids, holders = theirs.get("unit_ids"), self._unit_holders(i, units[i])
            if not isinstance(ids, list) or len(set(ids)) != len(ids) or not all(
                    isinstance(u, int) and 0 <= u < units[i] and holders[u] for u in ids):
                raise ValueError(f"layout descriptor: buffers[{i}] ({mine['name']}) unit_ids: "
                                 f"{ids!r} are not distinct units of the {units[i]} that this "
                                 f"decode node holds some of")
            which.append(ids)
        if not any(which):
            raise ValueError("layout descriptor: unit_ids: the offer carries no unit of any "
                             "buffer")
        return units, which

    def pull_specs(self, bucket: int, units: Sequence[int],
                   which: Sequence[Sequence[int]] | None = None) -> list:
        """``jax.ShapeDtypeStruct`` of every unit a decode pulls (``which``: the ids per
        buffer, default all), buffer by buffer: unit ``u`` of a ``bucket``-page compact
        buffer, on the first device of this process that holds its heads."""
        import jax

        specs = []
        for b, dtype in enumerate(self._dtypes):
            shape = self._logical_shape(b, bucket)
            u_shape = (*shape[:3], shape[3] // units[b], *shape[4:])
            holders = self._unit_holders(b, units[b])
            ids = range(units[b]) if which is None else which[b]
            specs += [jax.ShapeDtypeStruct(u_shape, dtype, sharding=jax.sharding.
                                           SingleDeviceSharding(holders[u][0])) for u in ids]
        return specs

    def received_bytes(self, units: Sequence[int], which: Sequence[Sequence[int]],
                       pages: int) -> int:
        """Bytes this process's shards receive from ``pages`` pages of the units ``which``
        (ids per buffer of ``units``): each unit once per device holding it, as Mooncake
        counts the decode's shards."""
        total = 0
        for b, ids in enumerate(which):
            shape = self._logical_shape(b, pages)
            unit = math.prod(shape) // units[b] * np.dtype(self._dtypes[b]).itemsize
            holders = self._unit_holders(b, units[b])
            total += sum(unit * len(holders[u]) for u in ids)
        return total

    def assemble(self, pulled: Sequence[Any], bucket: int, units: Sequence[int]) -> list:
        """Every unit pulled (``pull_specs`` order, all ids) as one compact array per buffer
        in this pool's sharding (``_assemble``)."""
        got, k = {}, 0
        for b, n in enumerate(units):
            for u in range(n):
                got[(b, u)] = pulled[k]
                k += 1
        return self._assemble(got, bucket, units)

    def _assemble(self, got: dict, bucket: int, units: Sequence[int]) -> list:
        """Units ``(buffer, unit) -> array`` as compact arrays in this pool's sharding: each
        device of this process gets its units concatenated along the heads, a unit it lacks
        copied from the device it was pulled onto. ``ValueError`` naming the buffer and units
        when some unit this process holds did not arrive."""
        import jax
        import jax.numpy as jnp

        out = []
        for b, shape in enumerate(self._shapes):
            w = self.layout.buffers[b].num_heads // units[b]
            missing = sorted({u for u, devs in enumerate(self._unit_holders(b, units[b]))
                              if devs and (b, u) not in got})
            if missing:
                raise ValueError(f"dst_pages: units {missing} of buffer {self.names[b]} "
                                 f"arrived in no pulled chunk")
            pieces = []
            for dev in self._local_devs[b]:
                first, count = self._dev_heads[b][dev]
                parts = [got[(b, u)] for u in range(first // w, (first + count) // w)] \
                    if self._has_heads[b] else [got[(b, 0)]]
                x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=3)
                pieces.append(x if x.devices() == {dev} else jax.device_put(x, dev))
            out.append(jax.make_array_from_single_device_arrays(
                (shape[0], bucket, *shape[2:]), self._shardings[b], pieces))
        return out

    def offer_units(self, parts: Sequence[Any], units: Sequence[int],
                    which: Sequence[Sequence[int]] | None = None) -> list:
        """Prefill, transfer thread: the gathered compact arrays ``parts`` cut into the units
        a decode pulls (``units`` per buffer; ``which``: the ids, default all), each a
        single-device array sliced on a device of this process that holds its heads (no
        cross-device copy); a buffer of one unit gives the first shard."""
        out = []
        for b, (arr, u_n) in enumerate(zip(parts, units)):
            w = self.layout.buffers[b].num_heads // u_n
            shards = {sh.device: sh.data for sh in arr.addressable_shards}
            holders = self._unit_holders(b, u_n)
            for u in (range(u_n) if which is None else which[b]):
                dev = holders[u][0]
                data = shards[dev]
                if not self._has_heads[b]:
                    out.append(data)
                    continue
                lo = (u * w - self._dev_heads[b][dev][0]) * self._epu[b]
                hi = lo + w * self._epu[b]
                out.append(data if (lo, hi) == (0, data.shape[3]) else data[:, :, :, lo:hi])
        return out

    # -- device programs -------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"pages: {n} pages exceed the largest bucket {self.buckets[-1]}")

    def _gather(self, idx: np.ndarray) -> list:
        import jax.numpy as jnp

        out = self.runner.jits.gather_pages(self.runner.caches, jnp.asarray(idx, jnp.int32))
        return [out[n] for n in self.names]

    def _masked(self, parts: list, n: int) -> list:
        """``parts`` with rows ``>= n`` of the page axis zeroed (one jit per bucket)."""
        import jax

        if self._mask is None:
            self._mask = jax.jit(pad_mask)
        return self._mask(parts, np.int32(n))

    def _scatter(self, dst: Sequence[int], parts: list) -> None:
        bucket = int(parts[0].shape[1])
        idx = np.zeros(bucket, np.int32)          # padding rows: zeros into the null page 0
        idx[:len(dst)] = dst
        self.runner.scatter_pages(idx, self._masked(parts, len(dst)))

    def warmup(self) -> None:
        """Compile the gather, the padding mask and the scatter for every page bucket."""
        for b in self.buckets:
            self._scatter([], self._gather(np.zeros(b, np.int32)))

    # -- prefill ---------------------------------------------------------------------------
    def stage_out(self, pages: Sequence[int]) -> None:
        """Prefill, engine thread: gather ``pages`` into compact device arrays (dispatched,
        not waited for) and keep them for ``take_gathered``."""
        if len(pages) == 0:
            return
        idx = np.zeros(self._bucket(len(pages)), np.int32)   # padding reads the null page
        idx[:len(pages)] = pages
        parts = self._gather(idx)
        key = tuple(int(p) for p in pages)
        with self._lock:
            self._gathered.setdefault(key, collections.deque()).append((time.monotonic(),
                                                                        parts))

    def take_gathered(self, pages: Sequence[int]) -> list:
        """Prefill, transfer thread: the arrays ``stage_out(pages)`` gathered (oldest first);
        entries older than ``STALE_S`` (their room was cancelled) are dropped.
        ``ValueError`` when none is kept."""
        key = tuple(int(p) for p in pages)
        now = time.monotonic()
        with self._lock:
            for k in [k for k, q in self._gathered.items() if q and now - q[0][0] > STALE_S]:
                q = self._gathered[k]
                while q and now - q[0][0] > STALE_S:
                    q.popleft()
                if not q:
                    del self._gathered[k]
            q = self._gathered.get(key)
            if not q:
                raise ValueError(f"src_pages: no gathered arrays for pages {list(key)[:8]}")
            _, parts = q.popleft()
            if not q:
                del self._gathered[key]
        return parts

    def drop_gathered(self, pages: Sequence[int]) -> None:
        """Prefill: forget the arrays of ``pages`` (a chunk that will not be offered)."""
        try:
            self.take_gathered(pages)
        except ValueError:
            pass

    # -- decode ----------------------------------------------------------------------------
    def put_arrived(self, dst: Sequence[int], parts: list, room: int = 0) -> None:
        """Decode, pull thread: ``parts`` (ready, in the pool's sharding) hold decode pages
        ``dst`` of bootstrap_room ``room`` in their first rows; ``stage_in`` scatters them."""
        now = time.monotonic()
        with self._lock:
            self._arrived = [a for a in self._arrived if now - a.t <= STALE_S]
            self._arrived.append(_Arrival(tuple(int(p) for p in dst), parts, now,
                                          room=int(room)))

    def check_join(self, room: int, dst: Sequence[int], units: Sequence[int], bucket: int):
        """Decode: the arrival of chunk ``(room, dst)`` or None (caller holds the lock, or
        none before a pull); ``ValueError`` when it came with other unit counts or bucket."""
        key = tuple(int(p) for p in dst)
        a = next((a for a in self._arrived if (a.room, a.dst) == (room, key)
                  and a.parts is None), None)
        if a is not None and (a.counts, a.bucket) != (tuple(units), int(bucket)):
            raise ValueError(f"bucket: an offer of bootstrap_room {room} for pages "
                             f"{list(key)[:8]} has {bucket} pages / units {list(units)}, the "
                             f"chunk's earlier offer {a.bucket} / {list(a.counts)}")
        return a

    def put_units(self, dst: Sequence[int], units: Sequence[int],
                  which: Sequence[Sequence[int]], pulled: Sequence[Any], room: int = 0,
                  bucket: int | None = None) -> None:
        """Decode, pull thread: the units ``which`` (ids per buffer of ``units``; ``pulled``
        in that order, ready, ``bucket`` pages each: the offer's checked bucket) of chunk
        ``(room, dst)`` (``room``: its ``bootstrap_room``), joined to its other offers';
        ``stage_in`` assembles them. ``ValueError`` (nothing kept) as ``check_join``."""
        key, now = tuple(int(p) for p in dst), time.monotonic()
        bucket = int(pulled[0].shape[1]) if bucket is None and len(pulled) else bucket or 0
        got = dict(zip([(b, u) for b, ids in enumerate(which) for u in ids], pulled))
        with self._lock:
            self._arrived = [a for a in self._arrived if now - a.t <= STALE_S]
            a = self.check_join(int(room), key, units, bucket)
            if a is None:
                self._arrived.append(_Arrival(key, None, now, got, tuple(units), int(bucket),
                                              int(room)))
            else:
                a.units.update(got)

    def stage_in(self, pages: Sequence[int], room: int | None = None) -> None:
        """Decode, engine thread (a step boundary): scatter every pulled chunk whose pages are
        among ``pages`` (a room's pages) into the pool, of bootstrap_room ``room`` only when
        given (another room's chunks of those pages are stale: dropped); with ``mirror``
        (node 0 of a multi-host decode) the other nodes are told to scatter theirs first.
        ``ValueError`` naming the count when some page of ``pages`` arrived in no pulled
        chunk, or the units missing from one (nothing is scattered then: the room fails)."""
        want = {int(p) for p in pages}
        if not want:
            return
        with self._lock:
            mine = [a for a in self._arrived if set(a.dst) <= want
                    and (room is None or a.room == room)]
            self._arrived = [a for a in self._arrived if not set(a.dst) <= want]
        covered = set().union(*(a.dst for a in mine))
        try:
            if covered != want:
                raise ValueError(f"dst_pages: {len(want - covered)} of the room's {len(want)} "
                                 f"pages arrived in no pulled chunk")
            ready = [(a.dst, a.parts if a.parts is not None else self._assemble(
                a.units, a.bucket, a.counts)) for a in mine]
        except ValueError:
            self.num_missing_arrivals += 1
            raise
        if self.mirror is not None:
            self.mirror("kv_stage_in", pages=sorted(want),
                        **({} if room is None else {"room": int(room)}))
        for dst, parts in ready:
            self._scatter(dst, parts)

    def drop_arrived(self, pages: Sequence[int]) -> None:
        """Decode: forget the pulled chunks of ``pages`` (a room that failed); the other nodes
        of a multi-host decode too (``mirror``)."""
        want = {int(p) for p in pages}
        with self._lock:
            self._arrived = [a for a in self._arrived if not set(a.dst) <= want]
        if self.mirror is not None:
            self.mirror("kv_drop", pages=sorted(want))

    def num_arrived(self) -> int:
        """Pulled chunks not yet scattered."""
        with self._lock:
            return len(self._arrived)

    def close(self) -> None:
        """Forget every gathered (prefill) and pulled (decode) chunk: their device arrays are
        released with the last reference. Nothing is registered, so nothing else to undo."""
        with self._lock:
            self._gathered.clear()
            self._arrived.clear()
