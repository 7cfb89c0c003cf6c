"""TransferEngine: registry, fake backend, batch splitting, and real Mooncake loopback writes."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import corrupt_backend
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.transfer.engine import (FAKE_BOOTSTRAP_HOST, TransferError, available_backends,
                                   backend_for_bootstrap_host, create_transfer_engine)
from pdjax.transfer.fake import FakeTransferEngine
from pdjax.transfer.kv_copies import KVLayout, build_copies
from pdjax.transfer.metadata import MetadataBuffers

HOST = "127.0.0.1"


def _aligned(nbytes, fill=None, seed=0):
    """A 64-byte-aligned uint8 array (numpy's default alignment is only 16)."""
    raw = np.zeros(nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    arr = raw[off:off + nbytes]
    if fill == "random":
        arr[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return arr


# ---------------------------------------------------------------------------------------------
# Registry and fake backend.


@pytest.mark.slow      # starts a process
def test_registry():
    # The package registers only real backends; the tests add their corrupting one.
    code = "from pdjax.transfer.engine import available_backends as a; print(a())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "['fake', 'jax', 'mooncake']"
    corrupt_backend.register()
    assert {"fake", "mooncake", "mooncake-corrupt"} <= set(available_backends())
    with pytest.raises(ValueError, match="backend: 'nixl'"):
        create_transfer_engine("nixl")
    assert backend_for_bootstrap_host(FAKE_BOOTSTRAP_HOST, "mooncake") == "fake"
    assert backend_for_bootstrap_host("10.0.0.5", "mooncake") == "mooncake"
    assert backend_for_bootstrap_host(None, "mooncake") == "mooncake"
    eng = create_transfer_engine("fake", HOST)
    assert isinstance(eng, FakeTransferEngine) and eng.session_id.startswith("fake:")


def test_fake_counts_and_splits_batches():
    buf = _aligned(4096)
    eng = FakeTransferEngine(check_sources=True)
    eng.register_memory(buf.ctypes.data, buf.nbytes, label="kv")
    copies = [(buf.ctypes.data + (i % 64) * 64, 1 << 40, 64) for i in range(2500)]
    eng.batch_write("peer", copies)
    c = eng.counters()
    assert (c.bytes, c.copies, c.batches, c.largest_batch, c.failures) == (
        2500 * 64, 2500, 3, 1024, 0)
    eng.batch_write("peer", [])
    assert eng.counters().batches == 3
    small = FakeTransferEngine(max_batch=7)
    small.batch_write("peer", [(4096, 8192, 1)] * 15)
    assert small.counters().batches == 3 and small.counters().largest_batch == 7


def test_fake_failure_injection_and_validation():
    buf = _aligned(256)
    eng = FakeTransferEngine(check_sources=True)
    eng.register_memory(buf.ctypes.data, 256)
    eng.set_failure("injected")
    with pytest.raises(TransferError, match="injected"):
        eng.batch_write("peer", [(buf.ctypes.data, 4096, 8)])
    assert eng.counters().failures == 1 and eng.counters().bytes == 0
    eng.set_failure(None)
    with pytest.raises(ValueError, match=r"copies\[0\].src_addr.*not inside"):
        eng.batch_write("peer", [(buf.ctypes.data + 250, 4096, 8)])   # runs past the region
    with pytest.raises(ValueError, match=r"copies\[1\].length"):
        eng.batch_write("peer", [(buf.ctypes.data, 4096, 8), (buf.ctypes.data, 4096, 0)])
    with pytest.raises(ValueError, match=r"copies\[0\]"):
        eng.batch_write("peer", [(buf.ctypes.data, 4096)])
    with pytest.raises(ValueError, match="peer_session_id"):
        eng.batch_write("", [])
    with pytest.raises(ValueError, match="overlaps"):
        eng.register_memory(buf.ctypes.data + 100, 10)
    with pytest.raises(ValueError, match="not the start"):
        eng.unregister_memory(buf.ctypes.data + 1)
    with pytest.raises(ValueError, match="max_batch"):
        FakeTransferEngine(max_batch=0)
    eng.close()
    with pytest.raises(TransferError, match="closed"):
        eng.batch_write("peer", [(4096, 4096, 1)])


# ---------------------------------------------------------------------------------------------
# Mooncake, two engines in this process (``mooncake_pair`` in conftest.py).


def test_mooncake_session_ids(mooncake_pair):
    a, b = mooncake_pair
    for eng in (a, b):
        host, port = eng.session_id.rsplit(":", 1)
        assert host == HOST and 0 < int(port) < 65536
    assert a.session_id != b.session_id


def test_mooncake_paged_write_lands_byte_exact(mooncake_pair):
    a, b = mooncake_pair
    L, P_SRC, P_DST, BPP = 4, 300, 700, 256
    src = _aligned(L * P_SRC * BPP, "random", seed=3)
    dst = _aligned(L * P_DST * BPP)
    a.register_memory(src.ctypes.data, src.nbytes, label="kv")
    b.register_memory(dst.ctypes.data, dst.nbytes, label="kv")
    try:
        src_layout = KVLayout("layer_major", (KVBufferDesc((src.ctypes.data,), L, P_SRC, BPP),))
        dst_layout = KVLayout("layer_major", (KVBufferDesc((dst.ctypes.data,), L, P_DST, BPP),))
        rng = np.random.default_rng(5)
        n = 290
        src_pages = rng.permutation(np.arange(1, P_SRC))[:n]
        dst_pages = rng.permutation(np.arange(1, P_DST))[:n]
        copies = build_copies(src_layout, dst_layout, src_pages, dst_pages)
        assert len(copies) > a.max_batch                     # exercises the split
        before = a.counters()
        a.batch_write(b.session_id, copies)
        after = a.counters()
        assert after.bytes - before.bytes == n * L * BPP
        assert after.copies - before.copies == len(copies)
        assert after.batches - before.batches == -(-len(copies) // 1024)
        assert after.largest_batch == 1024

        s = src.reshape(L, P_SRC, BPP)
        d = dst.reshape(L, P_DST, BPP)
        np.testing.assert_array_equal(d[:, dst_pages], s[:, src_pages])
        untouched = np.setdiff1d(np.arange(P_DST), dst_pages)
        assert not d[:, untouched].any()
    finally:
        a.unregister_memory(src.ctypes.data)
        b.unregister_memory(dst.ctypes.data)


def test_mooncake_write_outside_registered_memory_fails(mooncake_pair):
    a, b = mooncake_pair
    src, dst = _aligned(4096, "random"), _aligned(4096)
    a.register_memory(src.ctypes.data, src.nbytes)
    b.register_memory(dst.ctypes.data, dst.nbytes)
    try:
        failures = a.counters().failures
        with pytest.raises(TransferError, match="mooncake write"):
            a.batch_write(b.session_id, [(src.ctypes.data, dst.ctypes.data + 4000, 200)])
        assert a.counters().failures == failures + 1
        # The engine keeps working after a refused write.
        a.batch_write(b.session_id, [(src.ctypes.data, dst.ctypes.data, 4096)])
        np.testing.assert_array_equal(dst, src)
    finally:
        a.unregister_memory(src.ctypes.data)
        b.unregister_memory(dst.ctypes.data)


def test_corrupting_backend_flips_exactly_one_kv_byte(mooncake_pair):
    _, target = mooncake_pair
    corrupt_backend.register()
    bad = create_transfer_engine("mooncake-corrupt", HOST)
    try:
        kv_src, kv_dst = _aligned(8192, "random", seed=9), _aligned(8192)
        meta_src, meta_dst = MetadataBuffers(2, 4), MetadataBuffers(2, 4)
        bad.register_memory(kv_src.ctypes.data, kv_src.nbytes, label="kv")
        meta_src.register(bad)
        target.register_memory(kv_dst.ctypes.data, kv_dst.nbytes, label="kv")
        meta_dst.register(target)
        meta_src.write(0, 1234, 42)
        copies = [(kv_src.ctypes.data + 1024, kv_dst.ctypes.data + 2048, 512),
                  (kv_src.ctypes.data, kv_dst.ctypes.data, 256),
                  meta_src.copy_to(0, meta_dst.base_addr, 1, 2, meta_dst.bytes_per_slot)]
        bad.batch_write(target.session_id, copies)
        assert bad.corruptions == 1
        expected = np.zeros_like(kv_dst)
        expected[2048:2560] = kv_src[1024:1536]
        expected[:256] = kv_src[:256]
        diff = np.flatnonzero(kv_dst != expected)
        assert diff.tolist() == [2048 + 1]                    # offset 1 of the first KV copy
        assert kv_dst[2049] == expected[2049] ^ 0x40
        assert meta_dst.read(1).bootstrap_room == 1234        # metadata untouched
        assert bad.counters().copies == 3                     # the flip is not counted

        # Only metadata in the batch: nothing to corrupt.
        meta_src.write(1, 99, 1)
        bad.batch_write(target.session_id,
                        [meta_src.copy_to(1, meta_dst.base_addr, 0, 2, meta_dst.bytes_per_slot)])
        assert bad.corruptions == 1 and meta_dst.room(0) == 99
    finally:
        bad.close()
        target.unregister_memory(kv_dst.ctypes.data)
        meta_dst.unregister(target)


# ---------------------------------------------------------------------------------------------
# Mooncake across two processes (the real PD shape), and a peer that dies.

_TARGET = r"""
import hashlib, json, sys
import numpy as np
from pdjax.transfer.engine import create_transfer_engine
eng = create_transfer_engine("mooncake", "127.0.0.1")
raw = np.zeros(NBYTES + 64, np.uint8)
off = (-raw.ctypes.data) % 64
buf = raw[off:off + NBYTES]
eng.register_memory(buf.ctypes.data, buf.nbytes, label="kv")
print(json.dumps({"session_id": eng.session_id, "addr": buf.ctypes.data}), flush=True)
sys.stdin.readline()
print(hashlib.sha256(buf.tobytes()).hexdigest(), flush=True)
eng.close()
"""


@pytest.mark.slow      # starts a process
def test_mooncake_cross_process_write_and_dead_peer(mooncake_pair):
    a, _ = mooncake_pair
    nbytes, page = 1 << 20, 4096
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    src = _aligned(nbytes, "random", seed=11)
    a.register_memory(src.ctypes.data, src.nbytes, label="kv")
    proc = subprocess.Popen([sys.executable, "-c", _TARGET.replace("NBYTES", str(nbytes))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        peer = json.loads(proc.stdout.readline())
        perm = np.random.default_rng(2).permutation(nbytes // page)
        copies = [(src.ctypes.data + i * page, peer["addr"] + int(p) * page, page)
                  for i, p in enumerate(perm)]
        a.batch_write(peer["session_id"], copies)
        expected = np.empty_like(src)
        expected.reshape(-1, page)[perm] = src.reshape(-1, page)
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == hashlib.sha256(expected.tobytes()).hexdigest()
        assert proc.wait(timeout=30) == 0
        # The peer is gone: the write fails promptly with TransferError, it does not hang.
        with pytest.raises(TransferError):
            a.batch_write(peer["session_id"], copies[:4])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        a.unregister_memory(src.ctypes.data)


@pytest.mark.slow      # starts a process
def test_transfer_package_never_imports_jax():
    code = ("import sys\n"
            "import pdjax.pd.protocol, pdjax.pd.bootstrap, pdjax.transfer.engine\n"
            "import pdjax.transfer.fake, pdjax.transfer.mooncake, pdjax.transfer.metadata\n"
            "import pdjax.transfer.kv_copies, pdjax.transfer.kv_export\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_server_args_take_the_backend_from_the_registry_and_the_pd_knobs():
    from pdjax.config import ServerArgs
    from pdjax.ports import free_port
    from pdjax.serve import parse_args

    with pytest.raises(ValueError, match="^disaggregation_transfer_backend: must be one of "
                                         "auto, fake, jax, mooncake"):
        ServerArgs(disaggregation_transfer_backend="nixl")
    corrupt_backend.register()
    assert ServerArgs(disaggregation_transfer_backend="mooncake-corrupt") \
        .disaggregation_transfer_backend == "mooncake-corrupt"
    args = parse_args(["--disaggregation-transfer-backend", "mooncake-corrupt",
                       "--disaggregation-transfer-path", "staging",
                       "--disaggregation-transfer-max-batch", "7", "--port", str(free_port())])
    assert (args.disaggregation_transfer_backend, args.disaggregation_transfer_path,
            args.disaggregation_transfer_max_batch) == ("mooncake-corrupt", "staging", 7)
    assert (ServerArgs().disaggregation_transfer_path,
            ServerArgs().disaggregation_transfer_max_batch) == ("auto", 1024)
    with pytest.raises(ValueError, match="^disaggregation_transfer_path: must be one of auto, "
                                         "direct, staging; got 'dma'"):
        ServerArgs(disaggregation_transfer_path="dma")
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError,
                           match="^disaggregation_transfer_max_batch: must be (a positive "
                                 "integer|an integer, got)"):
            ServerArgs(disaggregation_transfer_max_batch=bad)
