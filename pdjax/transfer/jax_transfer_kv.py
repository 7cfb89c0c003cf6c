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
decode devices. Heads that ``tp_model_config`` repeats (TP above the KV heads) are refused.

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
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.transfer.kv_export import KVLayout, kv_layout_fingerprint
from pdjax.transfer.local_kv import page_buckets

logger = logging.getLogger(__name__)

# Placeholder shard addresses of the layout peers see (never dereferenced): buffer b, shard s
# at _FAKE_BASE + b * 2**44 + s * 2**40 (1 TiB apart, inside the wire's 2**63 range).
_FAKE_BASE = 1 << 52
STALE_S = 900.0          # gathered / pulled arrays nobody took are dropped after this long


@dataclasses.dataclass
class _Arrival:
    dst: tuple[int, ...]
    parts: list[Any]
    t: float


def _descriptor_layout(arrays: Sequence[Any], head_repeat: int,
                       row_heads: Sequence[int]) -> KVLayout:
    """The ``KVLayout`` of ``arrays`` with placeholder addresses (one shard each)."""
    from pdjax.transfer.kv_export import (_head_axis, _logical_heads, _shard_heads,
                                          _sorted_shards)

    buffers = []
    for b, (arr, rh) in enumerate(zip(arrays, row_heads)):
        name = f"arrays[{b}]"
        shards = _sorted_shards(arr)
        axis = _head_axis(arr, rh, name)
        heads = tuple(_shard_heads(arr, s, axis, head_repeat, name) for s in shards)
        bytes_per_page = math.prod(shards[0].data.shape[2:]) * arr.dtype.itemsize
        buffers.append(KVBufferDesc(
            shard_addrs=tuple(_FAKE_BASE + (b << 44) + (s << 40) for s in range(len(shards))),
            num_layers=arr.shape[0], num_pages=arr.shape[1], bytes_per_page=bytes_per_page,
            num_heads=_logical_heads(axis, head_repeat, name), shard_heads=heads,
            head_bytes=bytes_per_page // (arr.shape[2] * heads[0][1])))
    return KVLayout("layer_major", tuple(buffers))


def pad_mask(parts: Sequence[Any], n) -> list:
    """Compact arrays ``[layers, bucket, ...]`` with rows ``>= n`` (an int32 scalar) of the
    page axis set to zero: the decode's padding rows, which it scatters into the null page."""
    import jax.numpy as jnp

    def one(p):
        keep = (jnp.arange(p.shape[1]) < n).reshape(1, -1, *([1] * (p.ndim - 2)))
        return jnp.where(keep, p, jnp.zeros((), p.dtype))
    return [one(p) for p in parts]


def lower_transfer_programs(caches: dict, bucket: int, units: int) -> list[tuple[str, Any]]:
    """The device programs this backend adds to the runner's ``gather_pages`` and
    ``scatter_pages``, lowered for AOT compiles (``scripts/aot_jax_transfer.py``):
    ``(name, jax.stages.Lowered)`` for the decode's padding mask over every buffer of a
    ``bucket``-page chunk in the pool's sharding, and, for the first buffer whose row splits
    into ``units`` head-group units (> 1), the prefill's slice of one unit out of a device's
    shard and the decode's concatenation of one device's units. ``caches``: ``{name:
    jax.ShapeDtypeStruct}`` of the pool, with shardings."""
    import jax
    import jax.numpy as jnp

    S = jax.ShapeDtypeStruct
    parts = [S((c.shape[0], bucket, *c.shape[2:]), c.dtype, sharding=c.sharding)
             for c in caches.values()]
    out = [(f"jax_pad_mask n={bucket}",
            jax.jit(pad_mask).trace(parts, jax.ShapeDtypeStruct((), jnp.int32)).lower())]
    for name, p in zip(caches, parts):
        if units <= 1 or p.shape[3] % units:
            continue
        dev = jax.sharding.SingleDeviceSharding(next(iter(p.sharding.device_set)))
        shards = len(p.sharding.device_set) if p.sharding.shard_shape(p.shape)[3] < \
            p.shape[3] else 1
        width = p.shape[3] // units
        shard = S((*p.shape[:3], p.shape[3] // shards, *p.shape[4:]), p.dtype, sharding=dev)
        unit = S((*p.shape[:3], width, *p.shape[4:]), p.dtype, sharding=dev)
        if shard.shape[3] > width:
            out.append((f"jax_unit_slice {name} n={bucket}",
                        jax.jit(lambda x: x[:, :, :, :width]).trace(shard).lower()))
        per_device = max(1, units // len(p.sharding.device_set))
        if per_device > 1:
            out.append((f"jax_unit_concat {name} n={bucket}", jax.jit(
                lambda *us: jnp.concatenate(us, axis=3)).trace(*[unit] * per_device).lower()))
        break
    return out


class JaxLocalKV:
    """The runner's KV pool as the ``jax`` backend moves it (see the module docstring).

    Same surface as ``LocalKV`` (``layout``, ``fingerprint``, ``kv_dtype``, ``num_pages``,
    ``bytes_per_page``, ``num_layer_buffers``, ``check_addresses``, ``warmup``, ``stage_out``,
    ``stage_in``, ``close``; ``mode`` is ``"jax"``), plus ``take_gathered``/``drop_gathered``
    (prefill), ``offer_descriptor``/``check_offer``/``pull_specs``/``assemble``/
    ``put_arrived``/``drop_arrived`` (decode).
    ``engine``: the ``JaxTransferEngine`` (it is told about this pool: ``attach_kv``).
    Raises ``ValueError`` for a pool with shards in other processes (multi-host) or KV heads
    that ``tp_model_config`` repeats (``head_repeat`` > 1): not yet.
    """

    mode = "jax"

    def __init__(self, runner, engine, max_pages_per_seq: int = 64, head_repeat: int = 1):
        arrays = runner.kv_buffers()
        if not all(a.is_fully_addressable for a in arrays):
            raise ValueError("disaggregation_transfer_backend: 'jax' is single-host for now "
                             "(a KV buffer has shards in other processes: nnodes > 1)")
        if head_repeat != 1:
            raise ValueError(f"disaggregation_transfer_backend: 'jax' does not move KV heads "
                             f"that tp_size repeats (head_repeat {head_repeat}) yet")
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
        self.layout = _descriptor_layout(arrays, head_repeat, self.row_heads)
        # What the descriptors and pull specs need, read once here: the pool arrays are
        # donated by every step, so other threads must never touch them.
        self._shapes = [tuple(map(int, a.shape)) for a in arrays]
        self._dtypes = [a.dtype for a in arrays]
        self._shard_rows = [[tuple(map(int, sh.data.shape[2:])) for sh in a.addressable_shards]
                            for a in arrays]
        self._shardings = [runner.jits.cache_shardings[n] for n in self.names]
        self.num_shards = len(arrays[0].addressable_shards)
        # A buffer with KV heads (GQA's K and V) moves in head-group units; one without (an
        # MLA latent, the indexer keys) is one unit, replicated on every decode device.
        self._has_heads = [b.num_heads > 1 for b in self.layout.buffers]
        self.bytes_per_page = sum(b.num_layers * b.bytes_per_page * len(b.shard_addrs)
                                  for b in self.layout.buffers)
        self.num_address_changes = 0
        self.num_missing_arrivals = 0      # stage_in found no pulled rows for a page
        self._lock = threading.Lock()
        self._gathered: dict[tuple[int, ...], collections.deque] = {}
        self._arrived: list[_Arrival] = []
        self._mask = None
        if hasattr(engine, "attach_kv"):
            engine.attach_kv(self)

    @property
    def num_layer_buffers(self) -> int:
        return sum(b.num_layers * len(b.shard_addrs) for b in self.layout.buffers)

    def check_addresses(self) -> bool:
        """Never moves: nothing is registered by address."""
        return False

    # -- descriptors -----------------------------------------------------------------------
    def offer_descriptor(self, bucket: int, units: Sequence[int] | None = None) -> list[dict]:
        """Per buffer, what a compact ``bucket``-page array of this pool is and how it moves:
        ``name``, ``shape`` ``[layers, bucket, page_size, *row]``, ``dtype``,
        ``shard_shapes``, ``shard_heads`` (``[start, count]`` of checkpoint KV heads per
        shard), ``num_heads``, ``page_size``, ``kv_format``, and ``units`` (head-group units,
        default: one per shard of a buffer with heads, else 1) with ``unit_shape`` (the shape
        of each unit: dimension 3 split ``units`` ways). JSON/msgpack-safe."""
        out = []
        for b, (name, shape, dtype, rows, desc) in enumerate(zip(
                self.names, self._shapes, self._dtypes, self._shard_rows, self.layout.buffers)):
            shape = [shape[0], int(bucket), *shape[2:]]
            u = int(units[b]) if units is not None else (
                len(desc.shard_heads) if self._has_heads[b] else 1)
            unit_shape = [*shape[:3], shape[3] // u, *shape[4:]]
            out.append({"name": name, "shape": shape, "dtype": np.dtype(dtype).name,
                        "shard_shapes": [[shape[0], shape[1], *r] for r in rows],
                        "shard_heads": [list(h) for h in desc.shard_heads],
                        "num_heads": desc.num_heads, "page_size": self.page_size,
                        "kv_format": self.kv_dtype, "units": u, "unit_shape": unit_shape})
        return out

    def units_for(self, peer_shards: Sequence[int]) -> list[int]:
        """Head-group units per buffer between this pool and a peer whose buffers have
        ``peer_shards`` shards: ``max`` of the two shard counts for a buffer with heads (each
        unit on one device of either side), 1 for a buffer without. ``ValueError`` naming the
        buffer when the heads or either side's shards do not split into them."""
        out = []
        for b, (desc, theirs) in enumerate(zip(self.layout.buffers, peer_shards)):
            ours = len(desc.shard_heads)
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

    def check_offer(self, buffers: Any, dst: Sequence[int], bucket: int) -> list[int]:
        """The head-group units per buffer of an offer whose descriptor is ``buffers`` (the
        prefill's ``offer_descriptor(bucket, units)``). ``ValueError`` naming the field and
        both sides when it does not describe this pool's buffers (name, shape, dtype, heads,
        page size, KV format, units), when ``bucket`` is not one this pool compiled for, or
        ``dst`` (the decode pages) does not fit ``[1, num_pages)`` and the bucket."""
        if bucket not in self.buckets:
            raise ValueError(f"bucket: the prefill's {bucket} pages is not a bucket of this "
                             f"decode ({self.buckets})")
        if not 1 <= len(dst) <= bucket:
            raise ValueError(f"dst_pages: {len(dst)} pages for a {bucket}-page bucket")
        bad = [p for p in dst if not 1 <= int(p) < self.num_pages]
        if bad:
            raise ValueError(f"dst_pages: {bad[:4]} outside [1, {self.num_pages})")
        if not isinstance(buffers, (list, tuple)) or len(buffers) != len(self.names) \
                or not all(isinstance(d, dict) for d in buffers):
            raise ValueError(f"layout descriptor: prefill has {len(buffers or ())} KV buffers, "
                             f"decode {len(self.names)} ({self.names})")
        theirs_shards = [len(d.get("shard_heads") or ()) for d in buffers]
        if not all(theirs_shards):
            raise ValueError("layout descriptor: a buffer without shard_heads")
        units = self.units_for(theirs_shards)
        ours = self.offer_descriptor(bucket, units)
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
        return units

    def _unit_devices(self, b: int, bucket: int, units: int) -> list:
        """The device of this pool that holds each unit of buffer ``b`` (the first that
        does), and per device the units it holds, in ``devices_indices_map`` order."""
        shape = (self._shapes[b][0], bucket, *self._shapes[b][2:])
        width = shape[3] // units
        holders = []
        for dev, index in self._shardings[b].devices_indices_map(shape).items():
            sl = index[3]
            lo, hi = sl.start or 0, shape[3] if sl.stop is None else sl.stop
            holders.append((dev, [u for u in range(units) if lo <= u * width < hi]))
        where = [next(d for d, us in holders if u in us) for u in range(units)]
        return where, holders

    def pull_specs(self, bucket: int, units: Sequence[int]) -> list:
        """``jax.ShapeDtypeStruct`` of every unit a decode pulls, buffer by buffer: unit ``u``
        of a ``bucket``-page compact buffer, on the device of this pool that holds its heads
        (one device array each)."""
        import jax

        specs = []
        for b, (shape, dtype) in enumerate(zip(self._shapes, self._dtypes)):
            u_shape = (shape[0], bucket, *shape[2:3], shape[3] // units[b], *shape[4:])
            where, _ = self._unit_devices(b, bucket, units[b])
            specs += [jax.ShapeDtypeStruct(u_shape, dtype,
                                           sharding=jax.sharding.SingleDeviceSharding(d))
                      for d in where]
        return specs

    def assemble(self, pulled: Sequence[Any], bucket: int, units: Sequence[int]) -> list:
        """Decode, pull thread: the pulled units (``pull_specs`` order) as one compact array
        per buffer in this pool's sharding: each device's units concatenated along the heads
        on that device; a replicated buffer copied to the devices that lack it."""
        import jax
        import jax.numpy as jnp

        out, k = [], 0
        for b, shape in enumerate(self._shapes):
            mine = list(pulled[k:k + units[b]])
            k += units[b]
            full = (shape[0], bucket, *shape[2:])
            _, holders = self._unit_devices(b, bucket, units[b])
            pieces = []
            for dev, us in holders:
                parts = [mine[u] for u in us]
                x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=3)
                pieces.append(x if x.devices() == {dev} else jax.device_put(x, dev))
            out.append(jax.make_array_from_single_device_arrays(full, self._shardings[b],
                                                                pieces))
        return out

    def offer_units(self, parts: Sequence[Any], units: Sequence[int]) -> list:
        """Prefill, transfer thread: the gathered compact arrays ``parts`` cut into the units
        a decode pulls (``units`` per buffer), each a single-device array sliced on the
        device that holds its heads (no cross-device copy); a buffer of one unit gives the
        first shard."""
        out = []
        for arr, u in zip(parts, units):
            width = arr.shape[3] // u
            shards = sorted(arr.addressable_shards, key=lambda s: (s.index[3].start or 0,
                                                                   s.device.id))
            for k in range(u):
                lo, hi = k * width, (k + 1) * width
                for sh in shards:
                    sl = sh.index[3]
                    a, z = sl.start or 0, arr.shape[3] if sl.stop is None else sl.stop
                    if a <= lo and hi <= z:
                        out.append(sh.data if (a, z) == (lo, hi)
                                   else sh.data[:, :, :, lo - a:hi - a])
                        break
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
    def put_arrived(self, dst: Sequence[int], parts: list) -> None:
        """Decode, pull thread: ``parts`` (ready) hold decode pages ``dst`` in their first
        rows; ``stage_in`` scatters them."""
        now = time.monotonic()
        with self._lock:
            self._arrived = [a for a in self._arrived if now - a.t <= STALE_S]
            self._arrived.append(_Arrival(tuple(int(p) for p in dst), parts, now))

    def stage_in(self, pages: Sequence[int]) -> None:
        """Decode, engine thread (a step boundary): scatter every pulled chunk whose pages are
        among ``pages`` (a room's pages) into the pool. ``ValueError`` naming the count when
        some page of ``pages`` arrived in no pulled chunk (nothing is scattered then: the
        room fails)."""
        want = {int(p) for p in pages}
        if not want:
            return
        with self._lock:
            mine = [a for a in self._arrived if set(a.dst) <= want]
            self._arrived = [a for a in self._arrived if not set(a.dst) <= want]
        covered = set().union(*(a.dst for a in mine))
        if covered != want:
            self.num_missing_arrivals += 1
            raise ValueError(f"dst_pages: {len(want - covered)} of the room's {len(want)} "
                             f"pages arrived in no pulled chunk")
        for a in mine:
            self._scatter(a.dst, a.parts)

    def drop_arrived(self, pages: Sequence[int]) -> None:
        """Decode: forget the pulled chunks of ``pages`` (a room that failed)."""
        want = {int(p) for p in pages}
        with self._lock:
            self._arrived = [a for a in self._arrived if not set(a.dst) <= want]

    def num_arrived(self) -> int:
        """Pulled chunks not yet scattered."""
        with self._lock:
            return len(self._arrived)

    def close(self) -> None:
        with self._lock:
            self._gathered.clear()
            self._arrived.clear()
