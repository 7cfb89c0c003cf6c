"""Token sampling inside the jitted step (DESIGN.md §3, "Sampling").

Per forward the host passes ``SamplingInputs``: small arrays padded to the logits rows ``[R]``
(static shapes, so a new mix of requests never compiles). The device returns only the sampled
ids ``[max_rows]`` int32 (padded to a fixed length so the next step can refer to them), and
``token_logprob [R]`` / ``top_ids, top_logprobs [R, MAX_TOP_LOGPROBS]`` that the host fetches
only when a row asked for them. Costly parts run under ``lax.cond`` on flags (any sampled row,
any top-k/top-p row, any penalty, any logprob), so a greedy batch pays for an argmax only.

Definitions (the numpy oracle ``pdjax.runner.sampler.sample_token`` follows them exactly, in
float64; the device computes in float32):

- penalties (SGLang/vLLM): repetition on every token seen in prompt or output (positive logits
  divided, negative multiplied), then ``frequency * count + presence * (count > 0)`` over output
  counts subtracted. Greedy rows take the argmax of the penalized logits.
- ``p = softmax(x / temperature)``; with ``s`` = ``p`` sorted descending, the kept tokens are
  ``p >= threshold``, ``threshold = max(s[top_k - 1], min_p * s[0], s[m - 1])`` where ``m``
  counts the ``s[i]`` (among those passing top-k and min-p) whose exclusive prefix sum is below
  ``top_p`` times their sum. Ties at the threshold are all kept.
- the draw is inverse-CDF in vocabulary order from one uniform ``u`` per token:
  ``token = #{v : cumsum(q)[v] <= u * sum(q)}`` with ``q = p * kept`` (then moved back to the
  last kept token at or before it). ``u = uniform(fold_in(key(seed), position))`` with JAX's
  threefry key built from the 64-bit seed's two 32-bit words and ``position`` the index of the
  output token being drawn: the same seed gives the same draw whatever shares the batch.
- grammars (structured outputs): a row's token bitmask ``[ceil(V/32)]`` int32 (bit ``t % 32``
  of word ``t // 32`` allows token ``t``, ``pdjax.constrained.grammar``) sets the logits of
  disallowed tokens to ``-inf`` first, before penalties, temperature and filters; rows without
  a grammar have all-ones masks, and the masking runs only when ``any_grammar``.
- logit bias (OpenAI's ``logit_bias``): after the grammar mask and before the penalties,
  ``x[t] += bias[t]`` for the row's at most ``MAX_LOGIT_BIAS`` biased tokens (fixed-width
  ``[R, MAX_LOGIT_BIAS]`` id and value arrays; padding entries add 0 to token 0), only when
  ``any_logit_bias``.
- min_new_tokens (SGLang's ``min_new_tokens``, vLLM's ``min_tokens``): while a row's position
  is below its ``min_new_tokens``, its stop tokens (``held_stop_ids``, fixed width
  ``MAX_HELD_STOP_IDS``, padding -1: EOS unless ``ignore_eos``, and ``stop_token_ids``) are set
  to ``-inf`` after the grammar mask, only when ``any_held_stop``. A row this would leave with
  no token at all (a grammar that admits only its end) keeps them: the grammar wins.
- logprobs are the raw log-softmax of the model's logits (before the grammar mask, logit
  bias, penalties and temperature).

Penalty counts live on the device (``PenaltyTables``): one row per penalty slot, ``[S, V]``
output-token counts updated inside the step from the sampled ids, and ``[S, V]`` prompt-token
marks set once per request (``init_penalty_slot``). Slot 0 is the null slot of rows without
penalties.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pdjax.request import SamplingParams
from pdjax.runner.verify import draft_counts, verify_emitted

MAX_TOP_LOGPROBS = 20            # fixed top-logprobs width (OpenAI's limit of top_logprobs)
MAX_LOGIT_BIAS = SamplingParams.MAX_LOGIT_BIAS   # fixed logit-bias width per row (OpenAI: 300)
MAX_HELD_STOP_IDS = 64           # stop tokens min_new_tokens can hold back per row (EOS included)
SEED_LIMIT = 2 ** 63
# Penalized logits are clamped to this magnitude. XLA computes x / temperature in more than
# one fusion of the softmax, and float32 rounding of |x / t| differs between them: at |x / t|
# of 1e10 the difference overflows exp (NaN; measured on XLA:CPU). 1e4 / GREEDY_TEMPERATURE
# (1e-5) = 1e9 keeps it below exp's range (88); real logits are far smaller.
LOGIT_LIMIT = 1e4


class SamplingInputs(NamedTuple):
    """Per logits row ``[R]`` (padding rows: greedy, no penalty, slot 0) plus scalar flags."""

    temperature: jax.Array     # [R] f32; < GREEDY_TEMPERATURE means greedy
    top_k: jax.Array           # [R] i32; <= 0 means no limit
    top_p: jax.Array           # [R] f32 in (0, 1]
    min_p: jax.Array           # [R] f32 in [0, 1]
    repetition_penalty: jax.Array   # [R] f32
    frequency_penalty: jax.Array    # [R] f32
    presence_penalty: jax.Array     # [R] f32
    seed_words: jax.Array      # [R, 2] u32: (seed >> 32, seed & 0xffffffff)
    positions: jax.Array       # [R] i32: index of the output token being drawn
    penalty_slot: jax.Array    # [R] i32: row of the penalty tables; 0 = none
    samples: jax.Array         # [R] bool: the row's token is kept (counts are updated)
    bitmask: jax.Array         # [R, W] i32 allowed-token bits (W = ceil(V/32)); all ones = any
    logit_bias_ids: jax.Array  # [R, MAX_LOGIT_BIAS] i32 biased token ids (padding: 0)
    logit_bias: jax.Array      # [R, MAX_LOGIT_BIAS] f32 biases added to them (padding: 0)
    any_random: jax.Array      # [] bool: some row samples with a temperature
    any_filter: jax.Array      # [] bool: some row has top-k or top-p (needs a sort)
    any_penalty: jax.Array     # [] bool
    any_logprob: jax.Array     # [] bool
    any_top: jax.Array         # [] bool
    any_grammar: jax.Array     # [] bool: some row's bitmask restricts it
    any_logit_bias: jax.Array  # [] bool: some row has a logit bias
    draft_next: jax.Array      # [R] i32: the draft token this row's sample must equal for the
                               # next row of its verify span to count; -1: last row of a span
    any_draft: jax.Array       # [] bool: some row verifies a draft
    min_new_tokens: jax.Array  # [R] i32: the row's stop tokens are masked while positions < it
    held_stop_ids: jax.Array   # [R, MAX_HELD_STOP_IDS] i32 those stop tokens (padding: -1)
    any_held_stop: jax.Array   # [] bool: some row holds back its stop tokens


class StepOutputs(NamedTuple):
    """Device results of one step; the host fetches what it needs."""

    tokens: jax.Array          # [max_rows] i32 (rows past R are 0)
    token_logprob: jax.Array   # [R] f32 (0 unless any_logprob)
    top_ids: jax.Array         # [R, MAX_TOP_LOGPROBS] i32 (0 unless any_top)
    top_logprobs: jax.Array    # [R, MAX_TOP_LOGPROBS] f32
    emitted: jax.Array         # [R] bool: the row's token is kept (False: a draft before it
                               # in its verify span was rejected; ``verify_emitted``)


@dataclasses.dataclass
class SamplingRow:
    """Host-side parameters of one logits row (what ``build_sampling_inputs`` packs)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    position: int
    penalty_slot: int
    return_logprob: bool
    top_logprobs_num: int
    logit_bias: dict[int, float] | None = None
    draft_next: int = -1          # verify rows: the draft at the next position (-1: none)
    min_new_tokens: int = 0
    held_stop_ids: tuple[int, ...] = ()   # masked at this position (``held_stop_ids``)

    @classmethod
    def from_request(cls, req, penalty_slot: int = 0, position: int | None = None,
                     eos_token_ids=()) -> "SamplingRow":
        """Parameters of ``req``'s next draw (``position`` defaults to ``len(output_ids)``);
        ``eos_token_ids``: the model's, held back with ``stop_token_ids`` below
        ``min_new_tokens``. Raises ``ValueError`` naming the field for a seed or top-logprobs
        width out of range, or more than ``MAX_HELD_STOP_IDS`` stop tokens to hold back."""
        sp = req.sampling_params
        seed = req.seed_for_sampling
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        top = req.top_logprobs_num if req.return_logprob else 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        greedy = sp.is_greedy
        position = len(req.output_ids) if position is None else position
        held = sp.held_stop_ids(position, eos_token_ids)
        if len(held) > MAX_HELD_STOP_IDS:
            raise ValueError(f"stop_token_ids: min_new_tokens holds back at most "
                             f"{MAX_HELD_STOP_IDS} stop tokens (EOS included), got {len(held)}")
        return cls(temperature=0.0 if greedy else float(sp.temperature),
                   top_k=int(sp.top_k), top_p=float(sp.top_p), min_p=float(sp.min_p),
                   repetition_penalty=float(sp.repetition_penalty),
                   frequency_penalty=float(sp.frequency_penalty),
                   presence_penalty=float(sp.presence_penalty), seed=seed,
                   position=position, penalty_slot=penalty_slot,
                   return_logprob=bool(req.return_logprob), top_logprobs_num=top,
                   logit_bias=sp.logit_bias, min_new_tokens=int(sp.min_new_tokens),
                   held_stop_ids=held)


def uses_penalties(sp) -> bool:
    return sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


_ALL_ALLOWED: dict[tuple[int, int], np.ndarray] = {}


def all_allowed_bitmask(num_rows: int, words: int) -> np.ndarray:
    """A read-only all-ones ``[num_rows, words]`` int32 mask (shared; rows without a grammar)."""
    key = (num_rows, words)
    if key not in _ALL_ALLOWED:
        a = np.full(key, -1, np.int32)
        a.flags.writeable = False
        _ALL_ALLOWED[key] = a
    return _ALL_ALLOWED[key]


_NO_BIAS: dict[int, tuple[np.ndarray, np.ndarray]] = {}
_NO_HELD: dict[int, np.ndarray] = {}


def no_held_stop_ids(num_rows: int) -> np.ndarray:
    """A read-only ``[num_rows, MAX_HELD_STOP_IDS]`` int32 array of -1 (nothing held back)."""
    if num_rows not in _NO_HELD:
        a = np.full((num_rows, MAX_HELD_STOP_IDS), -1, np.int32)
        a.flags.writeable = False
        _NO_HELD[num_rows] = a
    return _NO_HELD[num_rows]


def no_logit_bias(num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Read-only zero ``[num_rows, MAX_LOGIT_BIAS]`` id (int32) and bias (float32) arrays."""
    if num_rows not in _NO_BIAS:
        ids = np.zeros((num_rows, MAX_LOGIT_BIAS), np.int32)
        vals = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
        ids.flags.writeable = vals.flags.writeable = False
        _NO_BIAS[num_rows] = (ids, vals)
    return _NO_BIAS[num_rows]


def build_sampling_inputs(rows: list[SamplingRow | None], num_rows_pad: int,
                          bitmask: np.ndarray | None = None,
                          vocab_size: int | None = None) -> SamplingInputs:
    """Pack ``rows`` (None: a row whose token is not kept) into numpy arrays ``[num_rows_pad]``.

    ``bitmask``: ``[num_rows_pad, ceil(V/32)]`` int32 grammar masks (all-ones rows allow every
    token), or None for none (then ``vocab_size`` sets the width of the all-ones mask; without
    it the width is 1, which the device widens to all-ones).
    """
    R = num_rows_pad
    temperature = np.zeros(R, np.float32)
    top_k = np.zeros(R, np.int32)
    top_p = np.ones(R, np.float32)
    min_p = np.zeros(R, np.float32)
    rep = np.ones(R, np.float32)
    freq = np.zeros(R, np.float32)
    pres = np.zeros(R, np.float32)
    seed_words = np.zeros((R, 2), np.uint32)
    positions = np.zeros(R, np.int32)
    slot = np.zeros(R, np.int32)
    samples = np.zeros(R, bool)
    draft_next = np.full(R, -1, np.int32)
    min_new = np.zeros(R, np.int32)
    held = no_held_stop_ids(R)
    if any(r is not None and r.held_stop_ids for r in rows):
        held = held.copy()
    any_logprob = any_top = False
    bias_ids, bias = no_logit_bias(R)
    if any(r is not None and r.logit_bias for r in rows):
        bias_ids, bias = bias_ids.copy(), bias.copy()
    for i, r in enumerate(rows):
        if r is None:
            continue
        samples[i] = True
        temperature[i], top_k[i], top_p[i], min_p[i] = r.temperature, r.top_k, r.top_p, r.min_p
        rep[i], freq[i], pres[i] = r.repetition_penalty, r.frequency_penalty, r.presence_penalty
        seed_words[i] = (r.seed >> 32, r.seed & 0xFFFFFFFF)
        positions[i], slot[i] = r.position, r.penalty_slot
        draft_next[i] = r.draft_next
        min_new[i] = r.min_new_tokens
        if r.held_stop_ids:
            if len(r.held_stop_ids) > MAX_HELD_STOP_IDS:
                raise ValueError(f"stop_token_ids: min_new_tokens holds back at most "
                                 f"{MAX_HELD_STOP_IDS} stop tokens, got {len(r.held_stop_ids)}")
            held[i, :len(r.held_stop_ids)] = r.held_stop_ids
        any_logprob |= r.return_logprob
        any_top |= r.top_logprobs_num > 0
        if r.logit_bias:
            if len(r.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, "
                                 f"got {len(r.logit_bias)}")
            n = len(r.logit_bias)
            bias_ids[i, :n] = list(r.logit_bias)
            bias[i, :n] = list(r.logit_bias.values())
    random = temperature > 0
    filt = random & (((top_k > 0) & (top_k < 1 << 30)) | (top_p < 1.0))
    pen = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    if bitmask is None:
        words = 1 if vocab_size is None else (vocab_size + 31) // 32
        bitmask, any_grammar = all_allowed_bitmask(R, words), False
    else:
        if bitmask.shape[0] != R or bitmask.dtype != np.int32:
            raise ValueError(f"bitmask must be [{R}, W] int32, got {bitmask.shape} {bitmask.dtype}")
        any_grammar = bool((bitmask != -1).any())
    return SamplingInputs(temperature, top_k, top_p, min_p, rep, freq, pres, seed_words, positions,
                          slot, samples, bitmask, bias_ids, bias, np.bool_(random.any()),
                          np.bool_(filt.any()), np.bool_(pen.any() and slot.any()),
                          np.bool_(any_logprob), np.bool_(any_top), np.bool_(any_grammar),
                          np.bool_(bias.any()), draft_next, np.bool_((draft_next >= 0).any()),
                          min_new, held, np.bool_((held >= 0).any()))


# ---------------------------------------------------------------------------- the draw
def draw_uniforms(seed_words: jax.Array, positions: jax.Array) -> jax.Array:
    """``u [R]`` f32 in [0, 1): ``uniform(fold_in(threefry_key(seed_words[r]), positions[r]))``."""
    def one(words, pos):
        key = jax.random.wrap_key_data(words, impl="threefry2x32")
        return jax.random.uniform(jax.random.fold_in(key, pos), (), jnp.float32)
    return jax.vmap(one)(seed_words, positions)


_uniform_jit = jax.jit(draw_uniforms)


def uniform_for(seed: int, position: int) -> float:
    """The uniform of draw ``position`` of ``seed`` (the numpy oracle uses this, so both
    samplers share one definition of the draw)."""
    words = np.asarray([[seed >> 32, seed & 0xFFFFFFFF]], np.uint32)
    return float(np.asarray(_uniform_jit(words, np.asarray([position], np.int32)))[0])


# ---------------------------------------------------------------------------- device sampler
def apply_bitmask(x, bitmask):
    """``x [R, V]`` with the tokens ``bitmask [R, W]`` int32 disallows set to ``-inf`` (the
    device twin of ``pdjax.constrained.grammar.apply_bitmask``)."""
    R, V = x.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = jnp.right_shift(bitmask[:, :, None].view(jnp.uint32), shifts) & 1     # [R, W, 32]
    bits = bits.reshape(R, -1)
    if bits.shape[1] < V:            # a narrow all-ones placeholder: the rest allowed
        bits = jnp.pad(bits, ((0, 0), (0, V - bits.shape[1])), constant_values=1)
    return jnp.where(bits[:, :V] != 0, x, -jnp.inf)


def apply_logit_bias(x, ids, bias):
    """``x [R, V]`` with ``bias [R, B]`` f32 added at token ids ``ids [R, B]`` i32 of each row
    (padding entries add 0 to token 0)."""
    rows = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    return x.at[rows, ids].add(bias)


def hold_stop_tokens(x, ids, positions, min_new_tokens):
    """``x [R, V]`` with the tokens ``ids [R, H]`` i32 (padding -1) set to ``-inf`` in rows
    whose output position ``positions [R]`` is below ``min_new_tokens [R]``; a row left with no
    finite logit (a grammar that allows only its end) keeps its logits."""
    active = (positions < min_new_tokens)[:, None] & (ids >= 0)          # [R, H]
    rows = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    held = x.at[rows, jnp.maximum(ids, 0)].min(jnp.where(active, -jnp.inf, jnp.inf))
    return jnp.where((held > -jnp.inf).any(-1, keepdims=True), held, x)


def _apply_penalties(x, sp: SamplingInputs, prompt_seen, counts):
    c = counts[sp.penalty_slot]                       # [R, V] i32
    c = lax.cond(sp.any_draft, draft_counts, lambda c, d: c, c, sp.draft_next)
    seen = prompt_seen[sp.penalty_slot] | (c > 0)
    rep = sp.repetition_penalty[:, None]
    # A tiny penalty (validation allows any in (0, 2]) must not make a logit inf, and then
    # NaN in the softmax: clamped to LOGIT_LIMIT.
    x = jnp.where(seen, jnp.clip(jnp.where(x > 0, x / rep, x * rep), -LOGIT_LIMIT, LOGIT_LIMIT),
                  x)
    return x - sp.frequency_penalty[:, None] * c - sp.presence_penalty[:, None] * (c > 0)


def _thresholds_sorted(p, sp: SamplingInputs):
    V = p.shape[-1]
    s = -jnp.sort(-p, axis=-1)                        # [R, V] descending
    k = jnp.where((sp.top_k > 0) & (sp.top_k < V), sp.top_k, V)
    kth = jnp.take_along_axis(s, (k - 1)[:, None], axis=-1)[:, 0]
    thr = jnp.maximum(kth, sp.min_p * s[:, 0])
    pre = jnp.where(s >= thr[:, None], s, 0.0)
    excl = jnp.cumsum(pre, axis=-1) - pre
    keep = (pre > 0) & (excl < sp.top_p[:, None] * pre.sum(-1, keepdims=True))
    m = jnp.maximum(keep.sum(-1), 1)
    return jnp.maximum(thr, jnp.take_along_axis(s, (m - 1)[:, None], axis=-1)[:, 0])


def _draw(x, sp: SamplingInputs):
    """Sampled ids ``[R]`` of rows with a temperature (others: argmax, replaced later)."""
    V = x.shape[-1]
    t = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
    p = jax.nn.softmax(x / t[:, None], axis=-1)
    thr = lax.cond(sp.any_filter, _thresholds_sorted, lambda p, sp: sp.min_p * p.max(-1), p, sp)
    q = jnp.where(p >= thr[:, None], p, 0.0)
    cdf = jnp.cumsum(q, axis=-1)
    u = draw_uniforms(sp.seed_words, sp.positions)
    raw = jnp.minimum((cdf <= (u * cdf[:, -1])[:, None]).sum(-1), V - 1)
    iota = lax.broadcasted_iota(jnp.int32, q.shape, 1)
    last_kept = lax.cummax(jnp.where(q > 0, iota, -1), axis=1)
    return jnp.take_along_axis(last_kept, raw[:, None], axis=-1)[:, 0]


def sample(logits, sp: SamplingInputs, prompt_seen, counts, max_rows: int):
    """Sample one token per row of ``logits [R, V]`` (f32).

    Returns ``(StepOutputs, counts)``: ``counts [S, V]`` with each kept row's token counted in its
    penalty slot (slot 0 never counts).
    """
    R, V = logits.shape
    logits = logits.astype(jnp.float32)
    x = lax.cond(sp.any_grammar, apply_bitmask, lambda x, m: x, logits, sp.bitmask)
    x = lax.cond(sp.any_held_stop, hold_stop_tokens, lambda x, i, p, m: x, x, sp.held_stop_ids,
                 sp.positions, sp.min_new_tokens)
    x = lax.cond(sp.any_logit_bias, apply_logit_bias, lambda x, i, b: x, x, sp.logit_bias_ids,
                 sp.logit_bias)
    x = lax.cond(sp.any_penalty, _apply_penalties, lambda x, sp, a, b: x, x, sp,
                 prompt_seen, counts)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    drawn = lax.cond(sp.any_random, _draw, lambda x, sp: greedy, x, sp)
    tokens = jnp.where(sp.temperature > 0, drawn, greedy)
    emitted = verify_emitted(tokens, sp.draft_next)
    counted = sp.samples & (sp.penalty_slot > 0) & emitted
    counts = counts.at[sp.penalty_slot, tokens].add(counted.astype(counts.dtype))

    def logprobs(logits):
        lp = jax.nn.log_softmax(logits, axis=-1)
        tok_lp = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        return lp, tok_lp

    lp, tok_lp = lax.cond(sp.any_logprob, logprobs,
                          lambda l: (jnp.zeros_like(l), jnp.zeros((R,), jnp.float32)), logits)
    k = min(MAX_TOP_LOGPROBS, V)

    def top(lp):
        vals, ids = lax.top_k(lp, k)
        return ids.astype(jnp.int32), vals

    top_ids, top_vals = lax.cond(sp.any_top, top, lambda lp: (jnp.zeros((R, k), jnp.int32),
                                                              jnp.zeros((R, k), jnp.float32)), lp)
    padded = jnp.zeros((max_rows,), jnp.int32).at[:R].set(tokens)
    return StepOutputs(padded, tok_lp, top_ids, top_vals, emitted), counts


def prompt_logprobs(logits, target_ids, want_top):
    """Logprob of ``target_ids [N]`` under ``logits [N, V]`` and the top-k rows (under ``cond``)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(lp, target_ids[:, None], axis=-1)[:, 0]
    N, V = lp.shape
    k = min(MAX_TOP_LOGPROBS, V)

    def top(lp):
        vals, ids = lax.top_k(lp, k)
        return ids.astype(jnp.int32), vals

    ids, vals = lax.cond(want_top, top, lambda lp: (jnp.zeros((N, k), jnp.int32),
                                                    jnp.zeros((N, k), jnp.float32)), lp)
    return tok, ids, vals


def init_penalty_slot(prompt_seen, counts, slot, seen_row, counts_row):
    """Set penalty slot ``slot`` from host rows ``seen_row [V]`` bool, ``counts_row [V]`` i32."""
    return prompt_seen.at[slot].set(seen_row), counts.at[slot].set(counts_row)
