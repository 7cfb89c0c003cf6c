"""The prompt-lookup drafter and the adaptive controller around it (pdjax.spec)."""

import pytest

from pdjax.request import Request, SamplingParams
from pdjax.spec.controller import SpecController
from pdjax.spec.drafter import NgramDrafter, create_drafter


def test_draft_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    d = NgramDrafter(min_match_window=1, max_match_window=3)
    #      0  1  2  3  4  5  6  7  8  9 10
    ids = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # "6 7" ended at 2 and at 7; the latest (7) is followed by 2 6 7.
    assert d.draft_for("r", ids, 3) == [2, 6, 7]
    assert d.draft_for("r", ids, 1) == [2]
    # The 3-gram "2 6 7" has no earlier occurrence; "x 6 7" would need one: 2-gram wins.
    ids2 = ids + [2, 6, 7]
    # now "2 6 7" (n = 3) occurred ending at 10: the draft is what followed it.
    assert d.draft_for("r", ids2, 4) == [2, 6, 7]


def test_longer_window_beats_a_later_shorter_match():
    d = NgramDrafter(min_match_window=1, max_match_window=2)
    ids = [1, 2, 3, 9, 2, 4, 1, 2]
    # n = 2: "1 2" ended at 1 -> 3 9 2; n = 1 alone would take "2" at 4 -> 4.
    assert d.draft_for("r", ids, 3) == [3, 9, 2]


def test_no_match_gives_no_draft_and_the_index_grows_incrementally():
    d = NgramDrafter(min_match_window=2, max_match_window=4)
    assert d.draft_for("r", [1, 2, 3, 4], 3) == []
    assert d.draft_for("r", [1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # The request's ids grew; only the new n-grams are indexed, the old ones still match.
    assert d.draft_for("r", [1, 2, 3, 4, 1, 2, 3, 4, 7, 1, 2, 3], 2) == [4, 7]
    d.release("r")
    assert "r" not in d._state
    assert d.draft_for("r", [1], 3) == [] and d.draft_for("r", [1, 1], 0) == []


def test_bad_windows_name_the_flag():
    with pytest.raises(ValueError, match="min_match_window_size"):
        NgramDrafter(min_match_window=0)
    with pytest.raises(ValueError, match="max_match_window_size"):
        NgramDrafter(min_match_window=3, max_match_window=2)
    with pytest.raises(ValueError, match="speculative_algorithm"):
        create_drafter("eagle")


def _req(rid, ids):
    return Request(rid=rid, prompt_ids=list(ids), sampling_params=SamplingParams())


def test_controller_adapts_the_draft_length_and_backs_off():
    c = SpecController(NgramDrafter(1, 4), num_draft_tokens=5)
    r = _req("a", [1, 2, 3, 1, 2])
    assert c.wanted(r) == 4
    assert c.propose([r], [2]) == [[3, 1]]
    c.on_verified("a", 4, 4, 5)           # all accepted: stays at the most
    assert c.wanted(r) == 4
    c.on_verified("a", 4, 2, 3)           # some accepted: ask for that many next
    assert c.wanted(r) == 2
    c.on_verified("a", 2, 0, 1)           # none: halve
    assert c.wanted(r) == 1
    def steps(n):
        out = []
        for _ in range(n):
            c.begin_step()
            out.append((c.active("a"), c.wanted(r)))
        return out

    c.on_verified("a", 1, 0, 1)           # none at 1: back off 2 steps, then 1 draft again
    assert steps(3) == [(False, 0), (False, 0), (True, 1)]
    c.on_verified("a", 1, 0, 1)           # again: 4 steps
    assert steps(5) == [(False, 0)] * 4 + [(True, 1)]
    c.on_no_draft("a")                    # nothing found: back off 1 step, then 2, ...
    assert steps(2) == [(False, 0), (True, 1)]
    c.on_no_draft("a")
    assert steps(3) == [(False, 0), (False, 0), (True, 1)]
    c.on_draft("a")
    c.on_no_draft("a")                    # a draft in between resets the streak
    assert steps(2) == [(False, 0), (True, 1)]
    s = c.stats
    assert (s.num_verify_rows, s.num_draft_tokens, s.num_accepted_tokens) == (5, 12, 6)
    assert s.accept_len_hist == {5: 1, 3: 1, 1: 3}
    assert s.mean_accept_len == pytest.approx(11 / 5) and s.acceptance_rate == pytest.approx(0.5)
    c.release("a")
    assert c.wanted(r) == 4


def test_controller_without_adaptation_always_asks_for_the_most():
    c = SpecController(NgramDrafter(1, 4), num_draft_tokens=3, adaptive=False)
    r = _req("a", [1, 2])
    for _ in range(3):
        c.on_verified("a", 2, 0, 1)
        assert c.wanted(r) == 2
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        SpecController(NgramDrafter(), num_draft_tokens=1)
