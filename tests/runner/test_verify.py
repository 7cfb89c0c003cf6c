"""Verifying drafts on the device (``pdjax.runner.verify`` inside ``device_sampler.sample``):
the emitted prefix of each verify span, the penalty counts drafts add, and the lossless rule:
the emitted tokens are distributed as sampling without speculation (chi-square on a small
vocabulary), and a seeded row draws exactly the tokens it draws without speculation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from pdjax.request import Request, SamplingParams
from pdjax.runner import device_sampler as ds
from pdjax.runner.verify import draft_counts, verify_emitted

V = 8


def test_emitted_is_the_matching_prefix_of_each_span():
    # spans: [0] plain, [1 2 3] drafts 5 6, [4 5] draft 7, [6] plain (padding)
    draft_next = np.array([-1, 5, 6, -1, 7, -1, -1], np.int32)
    tokens = np.array([9, 5, 1, 4, 7, 3, 0], np.int32)
    em = np.asarray(verify_emitted(jnp.asarray(tokens), jnp.asarray(draft_next)))
    # span 1: 5 == 5 accepted, 1 != 6 rejected -> rows 1, 2 emitted, row 3 not
    # span 2: 7 == 7 accepted -> rows 4, 5 emitted
    assert em.tolist() == [True, True, True, False, True, True, True]
    tokens[1] = 4                  # first draft rejected: only the target's own token
    em = np.asarray(verify_emitted(jnp.asarray(tokens), jnp.asarray(draft_next)))
    assert em.tolist() == [True, True, False, False, True, True, True]


def test_draft_counts_add_the_drafts_before_each_row_of_its_span():
    draft_next = jnp.asarray([3, 3, 5, -1, 2, -1], jnp.int32)
    c = np.asarray(draft_counts(jnp.zeros((6, V), jnp.int32), draft_next))
    assert c[0].tolist() == [0] * V
    assert c[1].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    assert c[2].tolist() == [0, 0, 0, 2, 0, 0, 0, 0]
    assert c[3].tolist() == [0, 0, 0, 2, 0, 1, 0, 0]
    assert c[4].tolist() == [0] * V            # a new span starts
    assert c[5].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]


@functools.partial(jax.jit, static_argnums=4)
def _sample(logits, sp, seen, counts, max_rows):
    return ds.sample(logits, sp, seen, counts, max_rows)


def _req(seed, **sp):
    r = Request("r", [1], SamplingParams(**sp))
    r.seed_for_sampling = seed
    return r


def _run(logits_per_pos, drafts, seeds, params, spec=True):
    """Sample ``len(seeds)`` requests, each a verify span of ``len(drafts) + 1`` rows with the
    fixed ``logits_per_pos [k+1, V]`` (without ``spec``: the same rows, verifying nothing).
    Returns ``tokens [N, k+1]``, ``emitted [N, k+1]`` and the penalty counts of slot 1."""
    k1 = len(drafts) + 1
    rows = []
    for i, s in enumerate(seeds):
        req = _req(int(s), **params)
        for j in range(k1):
            row = ds.SamplingRow.from_request(req, 0, position=j)
            row.draft_next = drafts[j] if spec and j < len(drafts) else -1
            rows.append(row)
    n = len(rows)
    sp = ds.build_sampling_inputs(rows, n)
    seen = jnp.zeros((2, V), bool)
    counts = jnp.zeros((2, V), jnp.int32)
    logits = jnp.asarray(np.tile(logits_per_pos, (len(seeds), 1)), jnp.float32)
    out, _ = _sample(logits, ds.SamplingInputs(*map(jnp.asarray, sp)), seen, counts, n)
    tokens = np.asarray(out.tokens).reshape(len(seeds), k1)
    return tokens, np.asarray(out.emitted).reshape(len(seeds), k1)


def _expected(x, temperature, top_k):
    p = np.exp((x - x.max()) / temperature)
    p /= p.sum()
    kth = np.sort(p)[::-1][top_k - 1]
    p = np.where(p >= kth, p, 0.0)
    return p / p.sum()


def _chi2_pvalue(samples, p):
    support = p > 0
    assert np.all(np.isin(samples, np.nonzero(support)[0])), "a token outside the support"
    observed = np.bincount(samples, minlength=V)[support]
    return stats.chisquare(observed, p[support] * len(samples)).pvalue


def test_speculative_sampling_matches_plain_sampling_chi_square():
    rng = np.random.default_rng(33)
    logits = rng.standard_normal((3, V)).astype(np.float32) * 1.5
    # p at temperature 0.8 (before top-6): position 0 has token 5 at 0.37, position 1 token 0
    # at 0.65: the drafts are accepted often enough to test the rows after them too.
    drafts = [5, 0]
    params = {"temperature": 0.8, "top_k": 6}
    seeds = rng.integers(0, 2 ** 62, 6000)
    tok, em = _run(logits, drafts, seeds, params)
    plain, _ = _run(logits, drafts, seeds, params, spec=False)
    # Emitted rows form a prefix; the rows after a rejection are not emitted.
    assert np.all(em[:, 0])
    assert np.array_equal(em[:, 1], tok[:, 0] == 5)
    assert np.array_equal(em[:, 2], em[:, 1] & (tok[:, 1] == 0))
    # Seeded: a row draws what it draws without speculation (same seed, same position).
    assert np.array_equal(tok[em], plain[em])
    p0 = _expected(logits[0].astype(np.float64), 0.8, 6)
    p1 = _expected(logits[1].astype(np.float64), 0.8, 6)
    p2 = _expected(logits[2].astype(np.float64), 0.8, 6)
    # The first token: the target distribution (acceptance p(d), residual p without d).
    assert _chi2_pvalue(tok[:, 0], p0) > 1e-3
    assert _chi2_pvalue(plain[:, 0], p0) > 1e-3
    # Given the first draft accepted, the next emitted token is distributed as p1, and so on.
    assert em[:, 1].sum() > 1500 and em[:, 2].sum() > 300
    assert _chi2_pvalue(tok[em[:, 1], 1], p1) > 1e-3
    assert _chi2_pvalue(tok[em[:, 2], 2], p2) > 1e-3
    # Rejected first drafts: the emitted token is the residual p0 without token 5.
    rejected = tok[~em[:, 1], 0]
    residual = p0.copy()
    residual[5] = 0
    assert _chi2_pvalue(rejected, residual / residual.sum()) > 1e-3


def test_penalties_see_the_drafts_before_a_row():
    # Greedy with a strong frequency penalty: at position 1 the draft of position 0 counts as
    # an output token, so its logit drops by the penalty (as after accepting it without
    # speculation), and the argmax moves to the runner-up.
    logits = np.zeros((2, V), np.float32)
    logits[0, 3] = 5.0
    logits[1, 3], logits[1, 5] = 5.0, 4.0
    rows = []
    req = Request("r", [1], SamplingParams(temperature=0, frequency_penalty=2.0))
    for j, dn in enumerate([3, -1]):
        row = ds.SamplingRow.from_request(req, 1, position=j)
        row.draft_next = dn
        rows.append(row)
    sp = ds.build_sampling_inputs(rows, 2)
    seen = jnp.zeros((2, V), bool)
    counts = jnp.zeros((2, V), jnp.int32)
    out, counts = _sample(jnp.asarray(logits), ds.SamplingInputs(*map(jnp.asarray, sp)), seen,
                          counts, 2)
    assert np.asarray(out.tokens).tolist() == [3, 5]
    assert np.asarray(out.emitted).tolist() == [True, True]
    # The slot counts the emitted tokens once each (the draft is not counted twice).
    assert np.asarray(counts)[1].tolist() == [0, 0, 0, 1, 0, 1, 0, 0]


def test_min_new_tokens_rejects_a_drafted_stop_token_below_it():
    """A verify span (``verify_sampling_rows``) of a request with min_new_tokens 3 whose drafts
    are [4, 2, 2] (2 = EOS, the argmax everywhere, 4 the runner-up): row 0 takes 4 (EOS held),
    row 1 is at position 2 < 3, so EOS is held back and the draft 2 rejected: the span emits
    [4, 4]; with min_new_tokens 2 rows 1.. may draw EOS and every draft is accepted (the host's
    stop check then ends the request on the first EOS)."""
    from pdjax.engine.speculative import verify_sampling_rows

    logits = np.zeros((4, V), np.float32)
    logits[:, 2], logits[:, 4] = 5.0, 3.0
    emitted_tokens = []
    for min_new in (3, 2):
        req = _req(1, temperature=0.0, min_new_tokens=min_new)
        req.output_ids = [6]                        # the span's rows draw positions 1..4
        rows = verify_sampling_rows(req, [4, 2, 2], 0, eos_token_ids=(2,))
        assert [r.held_stop_ids for r in rows] == [(2,)] * (min_new - 1) + [()] * (5 - min_new)
        sp = ds.build_sampling_inputs(rows, 4)
        out, _ = _sample(jnp.asarray(logits), ds.SamplingInputs(*map(jnp.asarray, sp)),
                         jnp.zeros((2, V), bool), jnp.zeros((2, V), jnp.int32), 4)
        tokens, emitted = np.asarray(out.tokens)[:4], np.asarray(out.emitted)
        emitted_tokens.append(tokens[emitted].tolist())
    assert emitted_tokens == [[4, 4], [4, 2, 2, 2]]
