"""``pdjax.sched.admission.admit`` on its own: each of its four answers and the pages and books
each leaves (pure Python; no scheduler, no JAX)."""

from pdjax.request import Request, RequestState, SamplingParams
from pdjax.sched.admission import AdmitResult, admit
from pdjax.sched.kv_cache_manager import KVCacheManager
from pdjax.sched.kv_connector import NullConnector
from pdjax.sched.remote_kv import RemoteKV
from kv_fakes import WholePromptConnector

PS = 4


class _NotYet(NullConnector):
    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        return None


class _Recorder(NullConnector):
    def __init__(self):
        self.allocs = []

    def update_state_after_alloc(self, req, num_external_tokens):
        self.allocs.append((req.rid, num_external_tokens))


def _req(rid, n):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_new_tokens=4))


def _books(num_pages, connector):
    kv = KVCacheManager(num_pages, PS)
    return kv, RemoteKV(kv, 0, connector)


def test_a_local_request_starts_running_with_its_prefix_hit_and_no_own_pages_yet():
    conn = _Recorder()
    kv, remote = _books(16, conn)
    req = _req("a", 10)
    assert admit(req, kv, remote, []) is AdmitResult.RUNNING
    assert req.state == RequestState.RUNNING and req.pages == []   # pages come at schedule
    assert conn.allocs == [("a", 0)] and not remote.waiting
    assert kv.allocator.num_free == 15


def test_a_whole_prompt_from_elsewhere_gets_its_prompt_pages_and_waits_in_the_books():
    kv, remote = _books(16, WholePromptConnector())
    req = _req("d", 10)
    assert admit(req, kv, remote, []) is AdmitResult.REMOTE
    assert dict(remote.waiting) == {"d": req} and len(req.pages) == 3   # ceil(10 / 4)
    assert kv.allocator.num_free == 15 - 3
    kv.check([*remote.requests()])


def test_not_yet_leaves_the_request_queued_and_marked():
    kv, remote = _books(16, _NotYet())
    req = _req("n", 10)
    assert admit(req, kv, remote, []) is AdmitResult.NOT_YET
    assert remote.not_yet == {"n"} and req.pages == [] and kv.allocator.num_free == 15
    assert req.state == RequestState.WAITING


def test_no_room_changes_nothing_and_remote_only_skips_a_local_request():
    kv, remote = _books(4, WholePromptConnector())        # 3 usable pages
    big = _req("big", 20)                                  # 5 pages
    assert admit(big, kv, remote, []) is AdmitResult.NO_ROOM
    assert big.pages == [] and not remote.waiting and kv.allocator.num_free == 3
    kv, remote = _books(16, NullConnector())
    local = _req("l", 10)
    assert admit(local, kv, remote, [], remote_only=True) is AdmitResult.NO_ROOM
    assert local.state == RequestState.WAITING and kv.allocator.num_free == 15
