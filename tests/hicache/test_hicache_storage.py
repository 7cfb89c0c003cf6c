"""HiCache's storage tier (L3), ``--hicache-storage-backend file``: the record format and its
checks, the file backend, the flags, and through ``pdjax.Engine`` on the tiny llama: a
restarted engine with the same folder finds the pages; corrupt, truncated and foreign records
are refused and recomputed; a folder removed at runtime degrades to recompute (DESIGN.md §3,
"Storage tier"; issue 43)."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest

from hicache_utils import agree, cached_tokens, generate

from pdjax.engine import Engine
from pdjax.kv.hicache.page_hash import page_hashes
from pdjax.kv.hicache.storage import HEADER_BYTES, PageCodec, StoredPageError, kv_fingerprint
from pdjax.kv.hicache.storage_file import FileStorage

PAGE = 16
PROMPT = 310
FULL = (PROMPT - 1) // PAGE * PAGE      # 304
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
SHAPES = [((2, 9, 4, 3), np.float32), ((2, 9, 4, 1), np.uint8)]   # [layers, pages, ps, ...]


# ---- the record format -------------------------------------------------------------------
def _codec(model="m"):
    return PageCodec(SHAPES, kv_fingerprint(model, 4, [(f"b{i}", s, d)
                                                       for i, (s, d) in enumerate(SHAPES)]))


def _page(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, 4, 3)).astype(np.float32),
            rng.integers(0, 255, (2, 4, 1)).astype(np.uint8)]


def test_a_record_round_trips_and_every_fault_is_refused():
    codec, key = _codec(), b"k" * 16
    page = _page(0)
    rec = codec.encode(key, page)
    assert len(rec) == codec.record_bytes == HEADER_BYTES + 2 * 4 * 3 * 4 + 2 * 4
    for got, want in zip(codec.decode(key, rec), page):
        np.testing.assert_array_equal(got, want)
    flipped = bytearray(rec)
    flipped[-3] ^= 0x40
    faults = {"checksum mismatch": bytes(flipped),
              "truncated: ": rec[:-5],
              "truncated header": rec[:HEADER_BYTES - 1],
              "bad magic": b"X" + rec[1:],
              "another model or KV format": _codec("other").encode(key, page),
              "holds page": codec.encode(b"j" * 16, page),
              "payload length": rec[:40] + (10**6).to_bytes(8, "little") + rec[48:]}
    for why, bad in faults.items():
        with pytest.raises(StoredPageError, match=why):
            codec.decode(key, bad)
    with pytest.raises(ValueError, match="is not"):
        codec.encode(key, [page[0].astype(np.float64), page[1]])


def test_the_fingerprint_names_model_page_size_and_buffers():
    bufs = [("k", (2, 9, 4, 3), np.float32)]
    fp = kv_fingerprint("m", 4, bufs)
    assert fp == kv_fingerprint("m", 4, [("k", (2, 100, 4, 3), np.float32)])  # pool size
    others = [kv_fingerprint("n", 4, bufs), kv_fingerprint("m", 8, bufs),
              kv_fingerprint("m", 4, [("k", (2, 9, 4, 3), np.float16)]),
              kv_fingerprint("m", 4, [("v", (2, 9, 4, 3), np.float32)]),
              kv_fingerprint("m", 4, [("k", (3, 9, 4, 3), np.float32)])]
    assert len({fp, *others}) == 6
    # Two float8 formats numpy spells alike ("<V1"): still two fingerprints.
    import ml_dtypes

    a, b = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz
    assert np.dtype(a).str == np.dtype(b).str
    assert kv_fingerprint("m", 4, [("k", (2, 9, 4, 3), a)]) != \
        kv_fingerprint("m", 4, [("k", (2, 9, 4, 3), b)])


def test_file_storage_writes_atomically_and_a_removed_folder_is_a_miss(tmp_path):
    root = tmp_path / "store"
    fs = FileStorage(str(root))
    key = bytes(range(16))
    assert not fs.exists(key) and fs.get(key) is None
    fs.set(key, b"abc")
    fs.set(key, b"abcd")                       # replaced whole
    assert fs.exists(key) and fs.get(key) == b"abcd"
    files = [f for _, _, fs_ in os.walk(root) for f in fs_]
    assert files == [key.hex() + ".kv"]         # no temporary file left
    fs.delete(key)
    fs.delete(key)                              # twice: no error
    assert not fs.exists(key)
    shutil.rmtree(root)
    assert not fs.exists(key) and fs.get(key) is None
    with pytest.raises(OSError):
        fs.set(key, b"abc")
    assert not root.exists()                    # not made again behind the operator's back


class _Faulty:
    """A backend whose every call fails after ``fail`` is set, counting the calls."""

    def __init__(self):
        self.fail, self.calls, self.data = False, 0, {}

    def _call(self):
        self.calls += 1
        if self.fail:
            raise OSError("store gone")

    def exists(self, key):
        self._call()
        return key in self.data

    def get(self, key):
        self._call()
        return self.data.get(key)

    def set(self, key, record):
        self._call()
        self.data[key] = record

    def delete(self, key):
        self.data.pop(key, None)

    def close(self):
        pass


def test_a_failing_backend_is_left_alone_for_a_while_and_nothing_raises(caplog):
    from pdjax.kv.hicache.storage_tier import StorageTier

    backend, codec = _Faulty(), _codec()
    tier = StorageTier(backend, codec)
    keys = [bytes([i]) * 16 for i in range(3)]
    parts = [np.stack([_page(i)[k] for i in range(3)], axis=1) for k in range(2)]
    tier.submit_write(keys, parts)
    tier.flush()
    assert tier.stats.written_pages == 3 and tier.exists(keys[0])
    tier.submit_prefetch("r", keys, 1)
    tier.flush()
    (got,) = tier.take_results()
    assert (got.rid, got.start, got.num_pages, got.path) == ("r", 1, 2, keys)
    np.testing.assert_array_equal(got.parts[0], parts[0][:, 1:])
    backend.fail = True
    with caplog.at_level(logging.WARNING, logger="pdjax.kv.hicache.storage_tier"):
        assert not tier.exists(keys[0])                   # an error: a miss
        calls = backend.calls
        assert tier.is_down and not tier.exists(keys[0])  # not asked again for a while
        tier.submit_write([b"x" * 16], [p[:, :1] for p in parts])
        tier.flush()
        assert backend.calls == calls and tier.stats.writes_dropped == 1
    assert tier.stats.errors == 1
    assert "lookup failed (OSError('store gone'))" in caplog.text
    tier.close()


def test_two_models_sharing_a_folder_keep_their_own_pages(tmp_path):
    from pdjax.kv.hicache.storage_tier import StorageTier

    fs = FileStorage(str(tmp_path))
    key = b"k" * 16
    tiers = [StorageTier(fs, _codec(m)) for m in ("m", "n")]
    for seed, tier in enumerate(tiers):
        tier.submit_write([key], [p[:, None] for p in _page(seed)])
        tier.flush()
    for seed, tier in enumerate(tiers):
        assert tier.exists(key) and tier.stats.written_pages == 1
        tier.submit_prefetch("r", [key], 0)
        tier.flush()
        (got,) = tier.take_results()
        assert got.num_pages == 1 and tier.stats.corrupt_pages == 0
        np.testing.assert_array_equal(got.parts[0][:, 0], _page(seed)[0])
        tier.close()
    assert len([f for _, _, fs_ in os.walk(tmp_path) for f in fs_]) == 2


def test_a_mooncake_backend_without_a_master_fails_at_once_naming_it():
    import time

    from pdjax.kv.hicache.storage import make_storage_backend
    from pdjax.ports import free_port

    master = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"no Mooncake master answers at {master} "):
        make_storage_backend("mooncake", {"master_server_address": master})
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("argv,line", [
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
     "error: hicache_storage_backend_extra_config: backend 'file' needs \"path\" (a folder)\n"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
      "--hicache-storage-backend-extra-config", "{path"],
     "error: hicache_storage_backend_extra_config: not JSON: Expecting property name enclosed "
     "in double quotes: line 1 column 2 (char 1)\n"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
      "--hicache-storage-backend-extra-config", '{"path": "/tmp", "size": 3}'],
     "error: hicache_storage_backend_extra_config: unknown key(s) ['size'] for backend 'file' "
     "(known: ['model_id', 'path'])\n"),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
      '{"path": "/tmp"}'],
     "error: hicache_storage_backend: the storage tier sits behind the host tier; add "
     "enable_hierarchical_cache\n"),
    (["--hicache-storage-backend-extra-config", '{"path": "/tmp"}'],
     "error: hicache_storage_backend_extra_config: set without hicache_storage_backend\n"),
    (["--hicache-storage-backend", "nfs"],
     "error: hicache_storage_backend: invalid choice: 'nfs' (choose from 'file', "
     "'mooncake')\n"),
])
def test_storage_flag_errors_are_one_line(capsys, argv, line):
    from pdjax.serve import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "0", *argv])
    assert e.value.code == 2 and capsys.readouterr().err == line


# ---- through the engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(143)
    return [[int(t) for t in rng.integers(3, 250, PROMPT)] for _ in range(8)]


def _engine(ckpt, path, **extra):
    return Engine(ckpt, dtype="float32", page_size=PAGE, max_total_tokens=1024,
                  max_running_requests=4, chunked_prefill_size=256, context_length=512,
                  progress=False, enable_hierarchical_cache=True, hicache_ratio=4,
                  hicache_storage_backend="file",
                  hicache_storage_backend_extra_config=f'{{"path": "{path}"}}', **extra)


def _settle(engine):
    """Every copy and storage write done; the pools at rest (no pin, nothing waiting)."""
    core = engine.core
    core.kv_worker.flush()
    core.kv_worker.storage.flush()
    sched, conn = core.scheduler, core.scheduler.connector
    sched.check_invariants()
    conn.index.check()
    assert conn.index.num_pinned == 0 and not sched.waiting_remote and not sched.held
    assert not conn._prefetch and core.kv_worker.storage.num_prefetching == 0
    # Every device page not in the prefix cache is free again.
    load = core.get_load()
    assert load["num_used_pages"] == load["num_cached_pages"]
    return load


@pytest.fixture(scope="module")
def stored(tiny_checkpoints, prompts, tmp_path_factory):
    """A folder the first engine filled with the eight prompts, and its outputs (computed,
    nothing stored before: the reference)."""
    path = tmp_path_factory.mktemp("hicache") / "store"
    first = _engine(tiny_checkpoints["llama"], path)
    ref = generate(first, prompts, SP)
    assert cached_tokens(ref) == [0] * 8
    load = _settle(first)
    first.shutdown()
    assert load["hicache_storage_written_pages"] == 8 * (FULL // PAGE)
    assert load["hicache_storage_errors"] == 0
    return path, ref


def _copy(path, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(path, dst)
    return dst


def _file(root, prompt, page):
    """The file of ``prompt``'s page ``page``: one name in ``root`` ends with its hash."""
    key = page_hashes(prompt, PAGE, page + 1)[page].hex()
    (found,) = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                if f.endswith(key + ".kv")]
    assert os.path.basename(os.path.dirname(found)) == key[:2]
    return found


def test_a_restarted_engine_finds_the_stored_pages(tiny_checkpoints, prompts, stored, tmp_path):
    path, ref = stored
    engine = _engine(tiny_checkpoints["llama"], _copy(path, tmp_path))
    try:
        outs = generate(engine, prompts, SP)
        agree(ref, outs, "restarted")
        got = cached_tokens(outs)
        assert all(c >= 0.8 * PROMPT for c in got) and got == [FULL] * 8
        load = _settle(engine)
        # Only each prompt's last partial page was computed; the rest came from the store.
        assert load["num_prompt_tokens_computed"] == 8 * (PROMPT - FULL)
        assert load["hicache_storage_hit_tokens"] == 8 * FULL
        assert load["hicache_storage_read_bytes"] == 8 * FULL // PAGE * \
            load["hicache_bytes_per_page"]
        assert load["hicache_storage_written_pages"] == 0     # all stored already
        assert load["hicache_storage_corrupt_pages"] == load["hicache_storage_errors"] == 0
    finally:
        engine.shutdown()


def test_corrupt_truncated_and_foreign_records_are_recomputed(tiny_checkpoints, prompts, stored,
                                                              tmp_path, caplog):
    path, ref = stored
    root = _copy(path, tmp_path)
    with open(_file(root, prompts[0], 5), "r+b") as f:        # a payload byte flipped
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0x01]))
    with open(_file(root, prompts[1], 3), "r+b") as f:        # truncated
        f.truncate(HEADER_BYTES + 10)
    foreign = _file(root, prompts[2], 0)                      # another model's record
    with open(foreign, "rb") as f:
        rec = bytearray(f.read())
    rec[8:24] = b"\xff" * 16
    with open(foreign, "wb") as f:
        f.write(rec)
    engine = _engine(tiny_checkpoints["llama"], root)
    try:
        with caplog.at_level(logging.WARNING, logger="pdjax.kv.hicache.storage_tier"):
            outs = generate(engine, prompts, SP)
        agree(ref, outs, "bad records")
        # Each prompt uses the pages before its bad one; the rest is recomputed.
        assert cached_tokens(outs) == [5 * PAGE, 3 * PAGE, 0] + [FULL] * 5
        load = _settle(engine)
        assert load["hicache_storage_corrupt_pages"] == 3
        warned = " ".join(r.getMessage() for r in caplog.records)
        assert "refused" in warned and "checksum mismatch" in warned
        # The refused records were replaced by the recomputed pages' (write-through).
        codec = engine.core.kv_worker.storage.codec
        for prompt, page in ((0, 5), (1, 3), (2, 0)):
            key = page_hashes(prompts[prompt], PAGE, page + 1)[page]
            with open(_file(root, prompts[prompt], page), "rb") as f:
                codec.decode(key, f.read())
    finally:
        engine.shutdown()


def test_a_folder_removed_at_runtime_degrades_to_recompute(tiny_checkpoints, prompts, stored,
                                                          tmp_path, caplog):
    path, ref = stored
    root = _copy(path, tmp_path)
    engine = _engine(tiny_checkpoints["llama"], root)
    try:
        agree(ref[:2], generate(engine, prompts[:2], SP), "from the store")
        _settle(engine)
        shutil.rmtree(root)
        with caplog.at_level(logging.WARNING, logger="pdjax.kv.hicache.storage_tier"):
            outs = generate(engine, prompts, SP)
        agree(ref, outs, "folder removed")
        cached = cached_tokens(outs)
        assert cached[2:] == [0] * 6 and all(c > 0 for c in cached[:2]), cached
        load = _settle(engine)
        assert load["hicache_storage_errors"] > 0
        assert any("write failed" in r.getMessage() for r in caplog.records)
        assert not root.exists()
        # Still serving from the host tier.
        agree(ref, generate(engine, prompts, SP), "host tier after the removal")
        _settle(engine)
    finally:
        engine.shutdown()


def test_an_abort_during_a_prefetch_leaks_nothing(tiny_checkpoints, prompts, stored, tmp_path):
    from pdjax.engine_io import GenerateRequest
    from pdjax.request import SamplingParams

    path, ref = stored
    engine = _engine(tiny_checkpoints["llama"], _copy(path, tmp_path))
    core = engine.core
    sched, conn, worker = core.scheduler, core.scheduler.connector, core.kv_worker
    try:
        free = sched.allocator.num_free
        core.add_request(GenerateRequest("prefetch-then-abort", prompts[0],
                                         SamplingParams.from_dict(SP)))
        core.step()                          # admission: the store has it, prefetch started
        assert conn._prefetch == {"prefetch-then-abort": "pending"}
        assert sched.allocator.num_free == free and not sched.waiting_remote
        core.abort_request("prefetch-then-abort")
        assert not conn._prefetch
        worker.storage.flush()
        while core.has_work:
            core.step()
        core.drain()
        # Its pages reached the host all the same (a later request uses them), unpinned.
        assert conn.index.match(page_hashes(prompts[0], PAGE, FULL // PAGE), 0) == FULL // PAGE
        _settle(engine)
        outs = generate(engine, prompts[:1], SP)
        agree(ref[:1], outs, "after the abort")
        assert cached_tokens(outs) == [FULL]
        _settle(engine)
    finally:
        engine.shutdown()


def test_an_fp8_kv_cache_round_trips_through_the_store(tiny_checkpoints, prompts, tmp_path):
    """e4m3 pages and their per-token float32 scales (two buffers of other dtypes) stored by
    one engine, read by a restarted one: the same tokens and logprobs."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    first = _engine(tiny_checkpoints["llama"], tmp_path / "fp8", **fp8)
    try:
        dtypes = {np.dtype(s.dtype).name for s in first.core.runner.cache_specs}
        assert "float8_e4m3fn" in dtypes and len(dtypes) > 1, dtypes
        ref = generate(first, prompts[:4], SP)
        _settle(first)
    finally:
        first.shutdown()
    again = _engine(tiny_checkpoints["llama"], tmp_path / "fp8", **fp8)
    try:
        outs = generate(again, prompts[:4], SP)
        agree(ref, outs, "fp8 KV, restarted")
        assert cached_tokens(outs) == [FULL] * 4
        load = _settle(again)
        assert load["hicache_storage_hit_tokens"] == 4 * FULL
        assert load["hicache_storage_corrupt_pages"] == 0
    finally:
        again.shutdown()


class _CountingStore:
    """A storage tier stand-in: which keys it holds, the calls made."""

    def __init__(self, held=()):
        self.held, self.asked, self.prefetched = set(held), 0, []

    def exists(self, key):
        self.asked += 1
        return key in self.held

    def submit_prefetch(self, rid, path, start):
        self.prefetched.append((rid, start))


def test_admission_asks_the_store_once_per_request():
    from pdjax.kv.hicache.connector import HiCacheConnector
    from pdjax.kv.hicache.host_pool import HostIndex
    from pdjax.request import Request, SamplingParams
    from pdjax.sched.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(num_pages=16, page_size=4, chunked_prefill_size=64,
                                      max_context_len=64))
    conn = HiCacheConnector(sched.kv, HostIndex(8), 4)
    ids = list(range(100, 113))                      # 3 full pages and a token
    hashes = page_hashes(ids, 4)
    conn.storage = _CountingStore()                  # holds nothing
    miss = Request("miss", ids, SamplingParams(max_new_tokens=2, temperature=0.0))
    assert conn.get_num_new_matched_tokens(miss, 0) == 0
    assert conn.get_num_new_matched_tokens(miss, 0) == 0     # admission retried
    assert conn.storage.asked == 1
    conn.request_finished(miss)
    assert not conn._prefetch
    conn.storage = _CountingStore(held=hashes)
    hit = Request("hit", ids, SamplingParams(max_new_tokens=2, temperature=0.0))
    assert conn.get_num_new_matched_tokens(hit, 4) is None   # past a 1-page device hit
    assert conn.get_num_new_matched_tokens(hit, 4) is None   # still on its way
    assert conn.storage.asked == 1 and conn.storage.prefetched == [("hit", 1)]
    conn.prefetch_done("hit")                # nothing usable arrived: computed here
    assert conn.get_num_new_matched_tokens(hit, 4) == 0 and conn.storage.asked == 1
    conn.update_state_after_alloc(hit, 0)
    assert not conn._prefetch


def test_writes_past_the_backlog_bytes_are_dropped_and_counted():
    import threading

    from pdjax.kv.hicache.storage_tier import StorageTier

    gate = threading.Event()

    class _Slow(_Faulty):
        def exists(self, key):
            gate.wait(30)
            return super().exists(key)

    codec = _codec()
    tier = StorageTier(_Slow(), codec, max_pending_write_bytes=3 * codec.payload_bytes)
    assert tier.max_pending_write_pages == 3
    keys = [bytes([i]) * 16 for i in range(5)]
    parts = [np.stack([_page(i)[k] for i in range(5)], axis=1) for k in range(2)]
    tier.submit_write(keys[:2], [p[:, :2] for p in parts])      # queued (the store waits)
    tier.submit_write(keys[2:4], [p[:, 2:4] for p in parts])    # 4 > 3 pages: dropped
    tier.submit_write(keys[4:], [p[:, 4:] for p in parts])      # 3 pages: queued
    gate.set()
    tier.flush()
    assert tier.stats.writes_dropped == 2 and tier.stats.written_pages == 3
    assert [tier.exists(k) for k in keys] == [True, True, False, False, True]
    tier.close()
