"""Peer states and typed room failures (``pdjax/transfer/lifecycle.py``); pure Python."""

import pytest

from pdjax.transfer import lifecycle
from pdjax.transfer.lifecycle import (IllegalTransition, PeerState, RoomFailure,
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
    assert len(classes) == 13 and len(set(labels)) == 13 and "other" in labels
    assert sorted(labels) == ["aborted", "dst_pages", "fit", "lost", "metadata", "moved",
                              "other", "pair", "prompt_mismatch", "refused", "remote",
                              "timeout", "write"]
    f = lifecycle.Timeout("transfer timeout: bootstrap_room 5 not transferred within 3 s")
    assert str(f) == "transfer timeout: bootstrap_room 5 not transferred within 3 s"
    assert f.label == "timeout" and isinstance(f, RoomFailure)
    # The class decides, not the words: an abort whose text says "timeout" is an abort.
    assert lifecycle.Aborted("aborted by client: timeout in the UI").label == "aborted"
