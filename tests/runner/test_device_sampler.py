"""The device sampler against its numpy oracle (``pdjax.runner.sampler``): greedy exactly,
seeded draws exactly for the same seed and position, the top-k/top-p/min-p support sets,
penalties (with the device-side count tables), logprobs within 1e-5."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.request import Request, SamplingParams
from pdjax.runner import device_sampler as ds
from pdjax.runner.sampler import keep_threshold, log_softmax, sample_token

V = 64
MAX_ROWS = 16


@functools.partial(jax.jit, static_argnums=4)
def _sample(logits, sp, seen, counts, max_rows):
    return ds.sample(logits, sp, seen, counts, max_rows)


def _req(prompt=(1, 2), outputs=(), seed=7, logprob=False, top=0, **sp):
    r = Request("r", list(prompt), SamplingParams(**sp), return_logprob=logprob, top_logprobs_num=top)
    r.output_ids = list(outputs)
    r.seed_for_sampling = seed
    return r


def _tables(reqs_slots):
    """Penalty tables with each (req, slot) set from its prompt and outputs."""
    seen = np.zeros((MAX_ROWS + 1, V), bool)
    counts = np.zeros((MAX_ROWS + 1, V), np.int32)
    for req, slot in reqs_slots:
        if slot:
            seen[slot, req.prompt_ids] = True
            counts[slot] = np.bincount(req.output_ids, minlength=V)
    return jnp.asarray(seen), jnp.asarray(counts)


def _device(logits, reqs, penalties=False):
    """Sample every row of ``logits [R, V]`` for ``reqs`` on the device."""
    slots = [(r, i + 1 if penalties else 0) for i, r in enumerate(reqs)]
    seen, counts = _tables(slots)
    rows = [ds.SamplingRow.from_request(r, s) for r, s in slots]
    sp = ds.build_sampling_inputs(rows, len(reqs))
    out, counts = _sample(jnp.asarray(logits, jnp.float32), ds.SamplingInputs(*map(jnp.asarray, sp)),
                          seen, counts, MAX_ROWS)
    return jax.tree.map(np.asarray, out), np.asarray(counts)


def _logits(rng, n, scale=2.0):
    return (rng.standard_normal((n, V)) * scale).astype(np.float32)


def test_greedy_equals_oracle_exactly():
    rng = np.random.default_rng(0)
    logits = _logits(rng, MAX_ROWS)
    reqs = [_req(temperature=0.0) for _ in range(MAX_ROWS)]
    out, _ = _device(logits, reqs)
    assert out.tokens.tolist() == [sample_token(l.copy(), r).token_id for l, r in zip(logits, reqs)]
    assert out.tokens.tolist() == np.argmax(logits, -1).tolist()


def _random_params(rng):
    kind = rng.integers(0, 5)
    sp = {"temperature": float(rng.choice([0.5, 0.8, 1.0, 1.5]))}
    if kind == 1:
        sp["top_k"] = int(rng.integers(1, 20))
    elif kind == 2:
        sp["top_p"] = float(rng.uniform(0.3, 0.99))
    elif kind == 3:
        sp["min_p"] = float(rng.uniform(0.01, 0.3))
    elif kind == 4:
        sp.update(top_k=int(rng.integers(2, 40)), top_p=float(rng.uniform(0.5, 0.95)),
                  min_p=float(rng.uniform(0.0, 0.1)))
    return sp


def test_seeded_draws_equal_oracle_for_same_seed_and_position():
    rng = np.random.default_rng(1)
    compared = ties = 0
    for batch in range(40):
        logits = _logits(rng, MAX_ROWS)
        reqs = [_req(seed=int(rng.integers(0, 2 ** 63)), outputs=[3] * int(rng.integers(0, 50)),
                     **_random_params(rng)) for _ in range(MAX_ROWS)]
        out, _ = _device(logits, reqs)
        for i, r in enumerate(reqs):
            ref = sample_token(logits[i].copy(), r)
            if ref.margin < 1e-5:        # a float32-vs-float64 tie at a CDF boundary
                ties += 1
                continue
            compared += 1
            assert out.tokens[i] == ref.token_id, (batch, i, r.sampling_params)
    assert compared >= 0.99 * 40 * MAX_ROWS and ties <= 0.01 * 40 * MAX_ROWS


def test_draw_depends_on_seed_and_position_only():
    """The same (seed, position) gives the same token in any row of any batch; another seed or
    position another draw."""
    rng = np.random.default_rng(2)
    row = _logits(rng, 1, scale=0.3)[0]            # flat: many tokens are likely
    me = _req(seed=123456789012345, outputs=[5] * 9)
    alone, _ = _device(row[None], [me])
    others = _logits(rng, MAX_ROWS)
    others[11] = row
    busy_reqs = [_req(seed=s, temperature=0.7) for s in range(MAX_ROWS)]
    busy_reqs[11] = me
    busy, _ = _device(others, busy_reqs)
    assert busy.tokens[11] == alone.tokens[0]
    draws = {int(_device(row[None], [_req(seed=123456789012345, outputs=[5] * n)])[0].tokens[0])
             for n in range(30)}
    assert len(draws) > 5
    u = [ds.uniform_for(7, n) for n in range(3)] + [ds.uniform_for(8, 0), ds.uniform_for(2 ** 40 + 7, 0)]
    assert len(set(u)) == 5 and all(0 <= x < 1 for x in u)


@pytest.mark.parametrize("params", [{"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.2},
                                    {"top_k": 10, "top_p": 0.8, "min_p": 0.05}, {}])
def test_support_sets_match_oracle(params):
    rng = np.random.default_rng(3)
    row = _logits(rng, 1, scale=1.0)[0]
    probs = np.exp(log_softmax(row))
    sp = SamplingParams(**params)
    keep = set(np.nonzero(probs >= keep_threshold(probs, sp.top_k, sp.top_p, sp.min_p))[0].tolist())
    seen = set()
    for start in range(0, 480, MAX_ROWS):
        reqs = [_req(seed=start + i, outputs=[0] * (start + i), **params) for i in range(MAX_ROWS)]
        out, _ = _device(np.tile(row, (MAX_ROWS, 1)), reqs)
        seen |= set(out.tokens.tolist())
    if params.get("top_k") == 3:
        assert keep == set(np.argsort(-probs)[:3].tolist())
    if not params:
        assert len(keep) == V
    assert seen <= keep
    assert len(seen) >= min(len(keep), 10)        # and the draws do spread over the support


def test_penalties_match_oracle_and_counts_update():
    rng = np.random.default_rng(4)
    logits = _logits(rng, 8)
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    reqs = []
    for i in range(8):
        best = int(top2[i, 0])
        kind = i % 4
        if kind == 0:
            reqs.append(_req(prompt=[best], temperature=0, repetition_penalty=1.9))
        elif kind == 1:
            reqs.append(_req(prompt=[1], outputs=[best] * 5, temperature=0, frequency_penalty=2.0))
        elif kind == 2:
            reqs.append(_req(prompt=[1], outputs=[best], temperature=0, presence_penalty=2.0))
        else:
            reqs.append(_req(prompt=[best], outputs=[best, 7], temperature=0.9, seed=i,
                             repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5))
    out, counts = _device(logits, reqs, penalties=True)
    ref = [sample_token(l.copy(), r).token_id for l, r in zip(logits, reqs)]
    assert out.tokens[:8].tolist() == ref
    # The penalties changed some greedy choices away from the raw argmax.
    assert sum(out.tokens[i] != top2[i, 0] for i in range(8) if i % 4 != 3) >= 3
    for i, r in enumerate(reqs):        # the sampled token was counted in the request's slot
        expect = np.bincount(r.output_ids + [ref[i]], minlength=V)
        assert counts[i + 1].tolist() == expect.tolist()
    assert not counts[0].any() and not counts[9:].any()


def test_a_tiny_repetition_penalty_gives_a_valid_token_not_nan():
    """A penalty of 1e-40 (subnormal in float32) divided positive logits to inf, the softmax
    to NaN, and the sampled id left the vocabulary (-1: a 500 in the server). The penalized
    logits are clamped: a seen token with a positive logit wins, as in the oracle."""
    rng = np.random.default_rng(9)
    logits = _logits(rng, 4)
    reqs = []
    for i in range(4):
        seen = [int(t) for t in np.argsort(-logits[i])[:3]]
        reqs.append(_req(prompt=seen, temperature=[0, 0.7, 1.0, 1e-3][i], seed=i,
                         repetition_penalty=[1e-40, 1e-40, 1e-30, 1e-38][i]))
    out, _ = _device(logits, reqs, penalties=True)
    ref = [sample_token(l.copy(), r).token_id for l, r in zip(logits, reqs)]
    assert out.tokens[:4].tolist() == ref
    for i, r in enumerate(reqs):
        assert out.tokens[i] in r.all_ids and logits[i, out.tokens[i]] > 0, (i, out.tokens)


def test_logprobs_and_top_logprobs_within_1e_5():
    rng = np.random.default_rng(5)
    logits = _logits(rng, MAX_ROWS, scale=4.0)
    reqs = [_req(logprob=True, top=int(k), temperature=float(t), seed=int(s))
            for k, t, s in zip(rng.integers(0, ds.MAX_TOP_LOGPROBS + 1, MAX_ROWS),
                               rng.choice([0.0, 1.0], MAX_ROWS), rng.integers(0, 1000, MAX_ROWS))]
    out, _ = _device(logits, reqs)
    for i, r in enumerate(reqs):
        ref = sample_token(logits[i].copy(), r)
        assert out.tokens[i] == ref.token_id or ref.margin < 1e-5
        lp = log_softmax(logits[i])
        assert abs(out.token_logprob[i] - lp[out.tokens[i]]) < 1e-5
        k = r.top_logprobs_num
        assert out.top_ids[i, :k].tolist() == [t for t, _ in ref.top_logprobs]
        assert np.abs(out.top_logprobs[i, :k] - [v for _, v in ref.top_logprobs]).max(initial=0) < 1e-5


def test_prompt_logprobs_on_device():
    rng = np.random.default_rng(6)
    logits = _logits(rng, 10, scale=3.0)
    targets = rng.integers(0, V, 10)
    tok, ids, vals = jax.jit(ds.prompt_logprobs)(jnp.asarray(logits), jnp.asarray(targets, jnp.int32),
                                                 jnp.asarray(True))
    lp = log_softmax(logits)
    assert np.abs(np.asarray(tok) - lp[np.arange(10), targets]).max() < 1e-5
    assert np.asarray(ids)[:, :5].tolist() == np.argsort(-lp, axis=-1, kind="stable")[:, :5].tolist()
    assert np.abs(np.asarray(vals) - -np.sort(-lp, axis=-1)[:, :ds.MAX_TOP_LOGPROBS]).max() < 1e-5


@pytest.mark.parametrize("seed", [-5, 2 ** 63, 1.5])
def test_bad_seed_is_refused_naming_the_field(seed):
    r = _req(temperature=1.0)
    r.seed_for_sampling = seed
    with pytest.raises(ValueError, match="seed"):
        ds.SamplingRow.from_request(r)


# ---------------------------------------------------------------------------- grammar bitmasks
def _random_bitmask(rng, rows, vocab, density):
    """``[rows, ceil(vocab/32)]`` int32 masks with about ``density`` of the tokens allowed (at
    least one per row); the row's allowed set."""
    allowed = rng.random((rows, vocab)) < density
    allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True
    words = (vocab + 31) // 32
    mask = np.zeros((rows, words), np.int64)
    for t in range(vocab):
        mask[:, t // 32] |= allowed[:, t].astype(np.int64) << (t % 32)
    return mask.astype(np.uint32).view(np.int32), allowed


@pytest.mark.parametrize("vocab", [64, 70, 100])
def test_device_bitmask_equals_numpy_oracle(vocab):
    from pdjax.constrained.grammar import apply_bitmask as np_apply

    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((8, vocab)).astype(np.float32) * 3
    mask, allowed = _random_bitmask(rng, 8, vocab, 0.3)
    got = np.asarray(jax.jit(ds.apply_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    want = np_apply(logits, mask)
    assert np.array_equal(np.isinf(got), ~allowed)
    assert np.array_equal(got, want)


def test_masked_sampling_equals_oracle_and_logprobs_stay_raw():
    """Greedy and seeded rows (with filters and penalties) under random masks draw the
    oracle's token, always an allowed one; the reported logprob is the unmasked one."""
    rng = np.random.default_rng(11)
    compared = 0
    for batch in range(12):
        logits = _logits(rng, MAX_ROWS)
        mask, allowed = _random_bitmask(rng, MAX_ROWS, V, float(rng.choice([0.05, 0.2, 0.6])))
        reqs = []
        for i in range(MAX_ROWS):
            sp = {"temperature": 0.0} if i % 3 == 0 else _random_params(rng)
            if i % 4 == 1:
                sp.update(repetition_penalty=1.3, frequency_penalty=0.5)
            reqs.append(_req(seed=int(rng.integers(0, 2 ** 63)), outputs=[3, 5, 3],
                             logprob=True, **sp))
        slots = [(r, i + 1) for i, r in enumerate(reqs)]
        seen, counts = _tables(slots)
        rows = [ds.SamplingRow.from_request(r, s) for r, s in slots]
        sp = ds.build_sampling_inputs(rows, MAX_ROWS, bitmask=mask)
        assert bool(sp.any_grammar)
        out, _ = _sample(jnp.asarray(logits), ds.SamplingInputs(*map(jnp.asarray, sp)),
                         seen, counts, MAX_ROWS)
        out = jax.tree.map(np.asarray, out)
        for i, r in enumerate(reqs):
            tok = int(out.tokens[i])
            assert allowed[i, tok], (batch, i)
            ref = sample_token(logits[i].copy(), r, bitmask=mask[i])
            assert ref.token_id == tok or ref.margin < 1e-5, (batch, i, r.sampling_params)
            compared += ref.token_id == tok
            assert out.token_logprob[i] == pytest.approx(log_softmax(logits[i])[tok], abs=1e-5)
    assert compared >= 0.99 * 12 * MAX_ROWS


def test_all_ones_mask_changes_nothing():
    rng = np.random.default_rng(12)
    logits = _logits(rng, MAX_ROWS)
    reqs = [_req(temperature=0.0) for _ in range(MAX_ROWS)]
    rows = [ds.SamplingRow.from_request(r, 0) for r in reqs]
    sp = ds.build_sampling_inputs(rows, MAX_ROWS, vocab_size=V)
    assert sp.bitmask.shape == (MAX_ROWS, 2) and not sp.any_grammar
    seen, counts = _tables([])
    out, _ = _sample(jnp.asarray(logits), ds.SamplingInputs(*map(jnp.asarray, sp)), seen, counts,
                     MAX_ROWS)
    assert np.asarray(out.tokens)[:MAX_ROWS].tolist() == np.argmax(logits, -1).tolist()


def test_logit_bias_equals_oracle_with_masks_and_penalties():
    """Rows with random logit biases (some of the full width, some with a grammar mask and
    penalties) draw the oracle's token; a +100 bias wins greedy and a -100 bias never wins;
    logprobs stay those of the raw logits."""
    rng = np.random.default_rng(13)
    logits = _logits(rng, MAX_ROWS)
    mask, allowed = _random_bitmask(rng, MAX_ROWS, V, 0.5)
    reqs = []
    for i in range(MAX_ROWS):
        sp = {"temperature": 0.0} if i % 2 == 0 else _random_params(rng)
        if i % 4 == 1:
            sp.update(repetition_penalty=1.2, presence_penalty=0.3)
        if i % 4 != 3:          # rows 3, 7, ...: no bias in a batch that has some
            ids = rng.choice(V, size=int(rng.integers(1, V)), replace=False)
            sp["logit_bias"] = {int(t): float(rng.uniform(-100, 100)) for t in ids}
        reqs.append(_req(seed=int(rng.integers(0, 2 ** 63)), outputs=[4, 9], logprob=True, **sp))
    # Greedy rows without a grammar mask (i % 2 == 0, i % 3 != 0): 2, 4, 8.
    winner = int(np.argmin(logits[2]))                 # the least likely token, pushed up
    top = int(np.argmax(logits[8]))
    for i, bias in ((2, {winner: 100.0}), (8, {top: -100.0}),
                    (4, {int(t): 0.5 for t in range(V)})):                 # 4: a flat shift
        reqs[i].sampling_params = dataclasses.replace(reqs[i].sampling_params, logit_bias=bias)
    slots = [(r, i + 1) for i, r in enumerate(reqs)]
    seen, counts = _tables(slots)
    rows = [ds.SamplingRow.from_request(r, s) for r, s in slots]
    grammar_rows = np.arange(MAX_ROWS) % 3 == 0
    rowmask = np.where(grammar_rows[:, None], mask, -1).astype(np.int32)
    sp = ds.build_sampling_inputs(rows, MAX_ROWS, bitmask=rowmask)
    assert bool(sp.any_logit_bias) and sp.logit_bias_ids.shape == (MAX_ROWS, ds.MAX_LOGIT_BIAS)
    out, _ = _sample(jnp.asarray(logits), ds.SamplingInputs(*map(jnp.asarray, sp)), seen, counts,
                     MAX_ROWS)
    out = jax.tree.map(np.asarray, out)
    compared = 0
    for i, r in enumerate(reqs):
        tok = int(out.tokens[i])
        ref = sample_token(logits[i].copy(), r, bitmask=rowmask[i])
        assert ref.token_id == tok or ref.margin < 1e-5, (i, r.sampling_params)
        compared += ref.token_id == tok
        if grammar_rows[i]:
            assert allowed[i, tok]
        assert out.token_logprob[i] == pytest.approx(log_softmax(logits[i])[tok], abs=1e-5)
    assert compared >= MAX_ROWS - 1
    assert out.tokens[2] == winner
    assert out.tokens[8] == np.argsort(logits[8])[-2]
    assert out.tokens[4] == np.argmax(logits[4])


def test_no_logit_bias_is_the_shared_zero_arrays():
    rows = [ds.SamplingRow.from_request(_req(temperature=0.0), 0)] * 3
    sp = ds.build_sampling_inputs(rows, 4, vocab_size=V)
    assert not sp.any_logit_bias and not sp.logit_bias.any()
    assert sp.logit_bias_ids is ds.no_logit_bias(4)[0]
    biased = ds.SamplingRow.from_request(_req(temperature=0.0, logit_bias={"7": 3, 9: -2.5}), 0)
    sp = ds.build_sampling_inputs([None, biased], 4, vocab_size=V)
    assert sp.logit_bias_ids[1, :2].tolist() == [7, 9] and sp.logit_bias[1, :3].tolist() == [3, -2.5, 0]
    assert not ds.no_logit_bias(4)[1].any()            # the shared zeros were not written


@pytest.mark.parametrize("bias,needle", [({"x": 1}, "logit_bias"), ({"1": 101}, "logit_bias"),
                                         ({1: float("inf")}, "logit_bias"), ([1], "logit_bias"),
                                         ({str(i): 0 for i in range(301)}, "at most 300")])
def test_bad_logit_bias_names_the_field(bias, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(logit_bias=bias)
    with pytest.raises(ValueError, match="logit_bias: token id 64 is outside"):
        SamplingParams(logit_bias={"64": 1}).check_vocab_ids(V)


def test_min_new_tokens_holds_back_stop_tokens_below_its_position():
    """EOS (2) and stop_token_ids (5, 6) are the argmax (and the bulk of a sampled row's mass):
    below min_new_tokens they are never drawn, from it on they are; ignore_eos holds back only
    stop_token_ids; a grammar allowing only EOS keeps it. Same as the numpy oracle."""
    eos = (2,)
    logits = np.zeros((9, V), np.float32)
    logits[:, [2, 5, 6]] = 30.0
    logits[:, 11] = 10.0
    logits[:, 12] = 9.0
    logits[4, 5] = 31.0                     # ignore_eos row: EOS is free, 5 and 6 held back
    reqs = [_req(temperature=0.0, min_new_tokens=3, stop_token_ids=[5, 6]),                 # pos 0
            _req(outputs=[9, 9], temperature=0.0, min_new_tokens=3, stop_token_ids=[5, 6]),  # pos 2
            _req(outputs=[9, 9, 9], temperature=0.0, min_new_tokens=3, stop_token_ids=[5, 6]),
            _req(temperature=0.9, seed=11, min_new_tokens=1, stop_token_ids=[5, 6]),
            _req(temperature=0.0, min_new_tokens=2, stop_token_ids=[5, 6], ignore_eos=True),
            _req(temperature=0.0, stop_token_ids=[5, 6]),                                    # no min
            _req(temperature=0.0, min_new_tokens=2),                                         # EOS only
            _req(temperature=0.0, min_new_tokens=2, stop_token_ids=[5, 6], frequency_penalty=2.0,
                 outputs=[11]),
            _req(temperature=0.0, min_new_tokens=4)]                                         # grammar
    only_eos = np.zeros((len(reqs), (V + 31) // 32), np.int32) - 1
    only_eos[8] = 0
    only_eos[8, 0] = 1 << 2
    rows = [ds.SamplingRow.from_request(r, 1 if i == 7 else 0, eos_token_ids=eos)
            for i, r in enumerate(reqs)]
    assert rows[0].held_stop_ids == (2, 5, 6) and rows[2].held_stop_ids == ()
    assert rows[4].held_stop_ids == (5, 6)
    sp = ds.build_sampling_inputs(rows, len(reqs), bitmask=only_eos)
    assert sp.any_held_stop and sp.min_new_tokens.tolist()[:3] == [3, 3, 3]
    seen = jnp.zeros((2, V), bool)
    counts = jnp.zeros((2, V), jnp.int32).at[1, 11].set(1)
    out, _ = _sample(jnp.asarray(logits), ds.SamplingInputs(*map(jnp.asarray, sp)), seen, counts,
                     MAX_ROWS)
    got = out.tokens[:len(reqs)].tolist()
    assert got == [11, 11, 2, 11, 2, 2, 5, 12, 2], got
    for i, r in enumerate(reqs):
        ref = sample_token(logits[i].copy(), r, bitmask=only_eos[i], eos_token_ids=eos)
        assert ref.token_id == got[i], i
    assert not ds.build_sampling_inputs(rows[2:3] + rows[5:6], 2).any_held_stop
    assert ds.no_held_stop_ids(4).min() == -1 and not ds.no_held_stop_ids(4).flags.writeable


def test_too_many_held_stop_tokens_name_the_field():
    r = _req(min_new_tokens=1, stop_token_ids=list(range(3, 3 + ds.MAX_HELD_STOP_IDS)))
    with pytest.raises(ValueError, match="stop_token_ids: min_new_tokens holds back at most"):
        ds.SamplingRow.from_request(r, eos_token_ids=(2,))
    ds.SamplingRow.from_request(r, position=1, eos_token_ids=(2,))    # past it: nothing held
