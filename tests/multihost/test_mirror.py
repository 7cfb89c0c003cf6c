"""Node 0's runner calls as a follower receives them (``LeaderRunner`` -> ``wire`` ->
``FollowerCalls``), over recording runners: the follower makes the same call with equal
arrays, and refuses (``WireError`` naming the field) every value outside its runner's shapes."""

from __future__ import annotations

import types

import numpy as np
import pytest

from pdjax.distributed import wire
from pdjax.distributed.node import LeaderRunner, FollowerCalls
from pdjax.runner.device_sampler import SamplingRow, build_sampling_inputs
from pdjax.sched.batch import BatchRow, build_flat_batch
from pdjax.sched.buckets import Buckets

PAGE, PAGES, VOCAB, ROWS = 16, 33, 512, 4


class RecordingRunner:
    """The attributes ``LeaderRunner`` / ``FollowerCalls`` read, and a forward that records."""

    def __init__(self):
        self.buckets = Buckets.create(chunked_prefill_size=32, max_running_requests=ROWS,
                                      max_pages_per_seq=4, traced_pages_bound=True)
        self.cfg = types.SimpleNamespace(vocab_size=VOCAB)
        self.page_size, self.num_pages, self.max_rows = PAGE, PAGES, ROWS
        self.max_logits_rows = ROWS
        self.num_penalty_slots = ROWS + 1
        self.calls = []

    def logits_rows(self, key):
        return key.num_rows

    def make_batch(self, key, rows):
        return build_flat_batch(rows, page_size=PAGE, num_tokens_pad=key.num_tokens,
                                num_rows_pad=key.num_rows, pages_per_seq_pad=key.pages_per_seq,
                                num_logits_pad=key.num_rows, chunk_size=32)

    def forward(self, key, fb, sampling, prev_idx, prev_tokens, want_hidden=False,
                want_logits=False):
        out = types.SimpleNamespace(tokens=np.zeros(ROWS, np.int32))
        self.calls.append(("forward", key, fb, sampling, prev_idx, prev_tokens))
        hidden = np.zeros((key.num_tokens, 8), np.float32) if want_hidden else None
        if want_logits:
            return out, hidden, np.zeros((key.num_rows, VOCAB), np.float32)
        return out, hidden

    def resample(self, entry, logits, sampling, first, redo):
        self.calls.append(("resample", entry, logits, sampling, first, redo))
        return types.SimpleNamespace(tokens=np.ones(ROWS, np.int32))

    def prompt_logprobs_at(self, hidden, indices, target_ids, want_top):
        self.calls.append(("prompt_logprobs", hidden, list(indices), list(target_ids), want_top))

    def init_penalty_slot(self, slot, prompt_ids, output_ids):
        self.calls.append(("penalty_slot", slot, list(prompt_ids), list(output_ids)))


class Wire:
    def __init__(self):
        self.frames = []

    def send(self, op, **fields):
        self.frames.append(wire.encode(op, **fields))


@pytest.fixture()
def pair():
    leader, follower, cable = RecordingRunner(), RecordingRunner(), Wire()
    return LeaderRunner(leader, cable), leader, FollowerCalls(follower), follower, cable


def _step(lead, rows, prev_tokens=None, prev_idx=None, want_hidden=False, want_logits=False):
    key = lead.buckets.pick("mixed" if len(rows) > 1 else "prefill_chunk",
                            sum(len(r.input_ids) for r in rows), len(rows), 2)
    fb = lead.make_batch(key, rows)
    sampling = build_sampling_inputs(
        [SamplingRow.from_request(_req(), 0)] + [None] * (len(rows) - 1), key.num_rows,
        vocab_size=VOCAB)
    return lead.forward(key, fb, sampling, prev_idx, prev_tokens, want_hidden, want_logits)


def _req():
    from pdjax.request import Request, SamplingParams

    r = Request(rid="a", prompt_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0.7))
    r.seed_for_sampling = 1234
    return r


def test_follower_makes_the_leaders_calls_with_equal_arrays(pair):
    lead, leader, calls, follower, cable = pair
    rows = [BatchRow([7, 8, 9], 0, [3]), BatchRow([5] * 20, 0, [4, 5])]
    out, hidden, logits = _step(lead, rows, want_hidden=True, want_logits=True)
    lead.prompt_logprobs_at(hidden, [0, 2], [8, 9], True)
    lead.init_penalty_slot(2, [1, 2, 3], [4])
    redo = np.array([True, False, False, False])
    bitmask = np.full((ROWS, VOCAB // 32), -1, np.int32)
    bitmask[0, 0] = 6
    again = lead.resample("extend", logits, build_sampling_inputs(
        [SamplingRow.from_request(_req(), 0), None, None, None], ROWS, bitmask=bitmask), out, redo)
    prev_idx = np.full(16, -1, np.int32)
    prev_idx[0] = 0
    _step(lead, [BatchRow([-1], 3, [3])], prev_tokens=again.tokens, prev_idx=prev_idx)
    for frame in cable.frames:
        calls.call(wire.decode(frame))
    assert [c[0] for c in follower.calls] == [c[0] for c in leader.calls] == [
        "forward", "prompt_logprobs", "penalty_slot", "resample", "forward"]
    for ours, theirs in zip(follower.calls, leader.calls):
        if ours[0] == "forward":
            assert ours[1] == theirs[1]
            for name in ("input_ids", "positions", "slot_mapping", "page_indices", "kv_lens",
                         "cu_q_lens", "distribution", "logits_indices"):
                assert (getattr(ours[2], name) == getattr(theirs[2], name)).all(), name
            for a, b in zip(ours[3], theirs[3]):
                assert np.array_equal(np.asarray(a), np.asarray(b))
            assert (ours[4] == theirs[4]).all()
    assert follower.calls[1][2:] == ([0, 2], [8, 9], True)
    assert follower.calls[2][1:] == (2, [1, 2, 3], [4])
    resample = follower.calls[3]
    assert resample[1] == "extend" and resample[2].shape == (ROWS, VOCAB)
    assert (resample[5] == redo).all() and (resample[3].bitmask == bitmask).all()
    assert resample[4] is not None                   # the first draw's outputs, by number
    # The last forward reads the resample's tokens (the follower's own, named by number).
    assert (follower.calls[4][5] == np.ones(ROWS, np.int32)).all()


def _tampered(pair, edit):
    lead, _, calls, follower, cable = pair
    _step(lead, [BatchRow([7, 8, 9], 0, [3])])
    msg = wire.decode(cable.frames[-1])
    edit(msg)
    with pytest.raises(wire.WireError) as e:
        calls.call(wire.decode(wire.encode(msg.pop("op"), **{k: v for k, v in msg.items()
                                                             if k != "v"})))
    assert follower.calls == []
    return str(e.value)


def _set(msg, group, name, value):
    a = wire.decode_array(msg[group][name], name)
    a.flat[0] = value
    msg[group][name] = wire.encode_array(a)


@pytest.mark.parametrize("edit, needle", [
    (lambda m: _set(m, "batch", "page_indices", PAGES), "batch.page_indices: values outside"),
    (lambda m: _set(m, "batch", "slot_mapping", -1), "batch.slot_mapping: values outside"),
    (lambda m: _set(m, "batch", "input_ids", VOCAB), "batch.input_ids: values outside"),
    (lambda m: _set(m, "batch", "positions", 4 * PAGE), "batch.positions: values outside"),
    (lambda m: _set(m, "sampling", "penalty_slot", ROWS + 1), "sampling.penalty_slot"),
    (lambda m: m.__setitem__("prev_idx", wire.encode_array(np.full(16, ROWS, np.int32))),
     "prev_idx: values outside"),
    (lambda m: m["batch"].__setitem__("kv_lens", wire.encode_array(np.zeros(2, np.int32))),
     "batch.kv_lens: int32[2], expected int32[4]"),
    (lambda m: m["batch"].pop("input_ids"), "batch: expected fields"),
    (lambda m: m.__setitem__("key", ["extend", 24, 4, 4]), "is not a warmed-up bucket"),
    (lambda m: m.__setitem__("seq", 5), "seq: 5 is not an integer in [1, 2)"),
    (lambda m: m.__setitem__("prev", 0), "step 0 is not one of the kept forwards"),
    (lambda m: _set(m, "sampling", "logit_bias_ids", VOCAB), "sampling.logit_bias_ids"),
])
def test_follower_refuses_values_outside_its_shapes(pair, edit, needle):
    assert needle in _tampered(pair, edit)


def test_follower_refuses_unknown_step_references(pair):
    lead, _, calls, follower, cable = pair
    for bad in ({"hidden": 3, "indices": [0], "target_ids": [1], "want_top": False},
                {"hidden": 0, "indices": [0], "target_ids": [1], "want_top": False}):
        with pytest.raises(wire.WireError, match="hidden|kept forwards"):
            calls.call(wire.decode(wire.encode("prompt_logprobs", **bad)))
    with pytest.raises(wire.WireError, match=r"slot: 5 is not an integer in \[0, 5\)"):
        calls.call(wire.decode(wire.encode("penalty_slot", slot=5, prompt_ids=[], output_ids=[])))
    with pytest.raises(wire.WireError, match="prompt_ids: 512"):
        calls.call(wire.decode(wire.encode("penalty_slot", slot=1, prompt_ids=[512],
                                           output_ids=[])))
    empty = build_sampling_inputs([], ROWS, vocab_size=VOCAB)
    base = dict(seq=1, entry="extend", logits=1, first=1,
                sampling={k: wire.encode_array(np.asarray(v))
                          for k, v in zip(empty._fields, empty)},
                redo=wire.encode_array(np.zeros(ROWS, bool)))
    for bad, needle in ((dict(entry="train"), "entry: 'train' is not an entry point"),
                        (dict(logits=1), r"logits: 1 is not an integer in \[1, 1\)")):
        with pytest.raises(wire.WireError, match=needle):
            calls.call(wire.decode(wire.encode("resample", **dict(base, **bad))))
    with pytest.raises(wire.WireError, match="not a runner call"):
        calls.call(wire.decode(wire.encode("welcome")))
    assert follower.calls == []
