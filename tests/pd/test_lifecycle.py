"""Peer states and typed room failures (``pdjax/pd/lifecycle.py``); pure Python."""

import pytest

from pdjax.pd import lifecycle
from pdjax.pd.lifecycle import (IllegalTransition, PeerState, RoomFailure,
                                peer_transition)


def test_peer_transitions_are_checked():
    legal = {(PeerState.CONNECTING, PeerState.READY), (PeerState.CONNECTING, PeerState.FAILED),
             (PeerState.READY, PeerState.FAILED)}
    for old in PeerState:
        for new in PeerState:
            if (old, new) in legal:
                assert peer_transition(old, new) is new
            else:     # a failed peer is replaced, never revived; no self-loops
                with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
                    peer_transition(old, new)
    assert [s.value for s in PeerState] == ["connecting", "ready", "failed"]   # /pd_state


def test_failure_labels_are_distinct_and_the_message_is_the_text():
    classes = [c for c in vars(lifecycle).values()
               if isinstance(c, type) and issubclass(c, RoomFailure)]
    labels = [c.label for c in classes]
    assert len(classes) == 12 and len(set(labels)) == 12 and "other" in labels
    assert sorted(labels) == ["aborted", "dst_pages", "lost", "metadata", "moved",
                              "other", "pair", "prompt_mismatch", "refused", "remote",
                              "timeout", "write"]
    f = lifecycle.Timeout("transfer timeout: bootstrap_room 5 not transferred within 3 s")
    assert str(f) == "transfer timeout: bootstrap_room 5 not transferred within 3 s"
    assert f.label == "timeout" and isinstance(f, RoomFailure)
    # The class decides, not the words: an abort whose text says "timeout" is an abort.
    assert lifecycle.Aborted("aborted by client: timeout in the UI").label == "aborted"


def test_prefill_room_keeps_the_first_report_but_an_abort_wins():
    from pdjax.pd.lifecycle import KVPoll
    from pdjax.pd.rooms import PrefillRoom, prefer_failure

    r = PrefillRoom(room=9, created_s=0.0)
    kept = prefer_failure(None, lifecycle.WriteFailed("KV write to decode s failed: rc=-1"))
    kept = prefer_failure(kept, lifecycle.RoomFailure("decode engine 'd' is no longer registered"))
    assert isinstance(kept, lifecycle.WriteFailed)
    kept = prefer_failure(kept, lifecycle.Aborted("aborted by the decode server: client gone"))
    kept = prefer_failure(kept, lifecycle.WriteFailed("a later write error"))
    assert str(kept) == "aborted by the decode server: client gone"
    assert r.fail_reason is None                      # reported, not applied yet
    with pytest.raises(AssertionError):
        r.tombstone()                                 # only a failed room leaves one
    r.state, r.failure, r.status_code, r.peer_id = KVPoll.Failed, kept, 0, "d"
    t = r.tombstone()
    assert (t.room, t.state, t.fail_reason, t.peer_id, t.notified, t.output_sent, t.req) == \
        (9, KVPoll.Failed, "aborted by the decode server: client gone", "d", True, True, None)


def test_prefill_peer_moves_along_its_table():
    from pdjax.pd.rooms import PrefillPeer

    p = PrefillPeer("10.0.0.1", 8998, "decode-x-0")
    assert p.state is PeerState.CONNECTING and p.reason == ""
    p.set_ready()
    assert p.state is PeerState.READY and p.reason == ""
    p.fail(lifecycle.PeerLost("lost connection with prefill 10.0.0.1:8998 (2 failed heartbeats)"))
    assert p.state is PeerState.FAILED and p.failure.label == "lost"
    assert p.reason.startswith("lost connection")
    with pytest.raises(IllegalTransition, match="failed -> ready"):
        p.set_ready()                                # a failed peer is replaced, never revived


def test_completed_rooms_are_kept_for_their_ttl_oldest_first():
    from pdjax.pd.rooms import CompletedRooms

    done = CompletedRooms(ttl_s=10.0)
    done.add(5, now=100.0)
    done.add(7, now=103.0)
    done.add(5, now=104.0)                 # completed again: kept from its latest completion
    assert 5 in done and 7 in done and 9 not in done and len(done) == 2
    done.expire(now=113.5)                 # 7 completed 10.5 s ago, 5 only 9.5 s ago
    assert 7 not in done and 5 in done and len(done) == 1
    done.expire(now=114.0)                 # exactly the ttl: gone
    assert 5 not in done and len(done) == 0
    done.expire(now=200.0)                 # empty: nothing to do
