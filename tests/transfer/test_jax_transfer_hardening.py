"""The ``jax`` backend's reviewed edges in one process: gathered arrays released on every
failed write (``write_pages``, the prefill worker, node 0 of a multi-host prefill)."""

import types

import pytest
from pd_fakes import prefill_worker
from rank_fakes import FakeCluster
from test_jax_transfer import FakeRunner, Peer

from pdjax.pd.rooms import PrefillRoom
from pdjax.transfer.engine import TransferError, create_transfer_engine
from pdjax.transfer.jax_transfer_kv import JaxLocalKV
from pdjax.transfer.prefill_ranks import PrefillRanks
from pdjax.transfer.prefill_worker import RoomFailed


@pytest.fixture(scope="module")
def prefill():
    engine = create_transfer_engine("jax", "127.0.0.1", pull_timeout_s=2.0, ack_slack_s=1.0)
    yield engine, JaxLocalKV(FakeRunner(21), engine, max_pages_per_seq=8)
    engine.close()


def _kept(kv, pages) -> int:
    """How many gathered entries ``kv`` keeps for ``pages``."""
    return len(kv._gathered.get(tuple(pages), ()))


def test_write_pages_releases_the_chunk_when_its_metadata_row_is_refused(prefill):
    """``_meta_rows`` raised before the arrays were taken: they stayed until the stale sweep."""
    engine, kv = prefill
    kv.stage_out([3, 4])
    kv.stage_out([5])
    with pytest.raises(ValueError, match=r"meta\[0\].src_addr: \[0x10, \+64\) is not "
                                         r"registered"):
        engine.write_pages(kv, Peer("127.0.0.1:1", kv.layout), [3, 4], [1, 2], [(16, 0, 64)])
    assert _kept(kv, [3, 4]) == 0 and _kept(kv, [5]) == 1        # another chunk's stay
    kv.drop_gathered([5])


def _worker(kv, engine, copy_to):
    peer = types.SimpleNamespace(session_id="decode:1", layout=kv.layout,
                                 reply_endpoint="tcp://d:1", metadata_addr=0x5000,
                                 metadata_num_slots=4, metadata_bytes_per_slot=64)
    worker = prefill_worker(local_kv=kv, transfer_engine=engine,
                            meta=types.SimpleNamespace(copy_to=copy_to))
    worker._peers["d"] = peer
    return worker


def test_the_worker_drops_a_chunk_only_when_the_write_path_never_took_it(prefill, monkeypatch):
    engine, kv = prefill

    def refuse(*a):
        raise ValueError("meta: slot 9 outside [0, 4)")

    worker = _worker(kv, engine, refuse)
    try:
        kv.stage_out([3, 4])
        worker._write_chunk(PrefillRoom(7, 0.0), 7, "d", 9, 0, [3, 4], [1, 2], True)
        (event,) = worker.events()
        assert isinstance(event, RoomFailed) and "slot 9 outside" in str(event.failure)
        assert _kept(kv, [3, 4]) == 0          # copy_to raised before write_pages: dropped
    finally:
        worker.close()

    def fail_after_taking(local_kv, peer, src, dst, meta):
        local_kv.take_gathered(src)
        raise TransferError("jax pull by decode decode:1 failed: gone")

    monkeypatch.setattr(engine, "write_pages", fail_after_taking)
    worker = _worker(kv, engine, lambda *a: (0, 0, 0))
    try:
        kv.stage_out([3, 4])
        kv.stage_out([3, 4])                   # a later chunk of the same pages
        worker._write_chunk(PrefillRoom(8, 0.0), 8, "d", 0, 0, [3, 4], [1, 2], False)
        (event,) = worker.events()
        assert isinstance(event, RoomFailed) and "gone" in str(event.failure)
        assert _kept(kv, [3, 4]) == 1          # write_pages took its own; the later one stays
    finally:
        worker.close()
        kv.drop_gathered([3, 4])


def test_node_zero_drops_its_chunk_for_a_decode_that_is_not_paired():
    dropped = []
    local_kv = types.SimpleNamespace(layout=None, drop_gathered=dropped.append)
    bootstrap = types.SimpleNamespace(registered_ranks=lambda: [])
    ranks = PrefillRanks(FakeCluster(), bootstrap, local_kv, "tcp://127.0.0.1:1")
    engine = types.SimpleNamespace(write_pages=None)
    with pytest.raises(ValueError, match="decode engine 'd9' is not paired"):
        ranks.write(engine, "d9", [3, 4], [1, 2], [], ranks.writes.new_job(), 0.01)
    assert dropped == [[3, 4]]
