"""``real_logits_rows``: the count of real entries of a flat batch's ``logits_indices``, which
the LM head multiplies (its padding rows cost nothing on the packed CPU head)."""

import jax
import numpy as np
import pytest

from pdjax.runner.entry_points import real_logits_rows
from pdjax.sched.batch import BatchRow, build_flat_batch


def _rows(kind):
    pages = list(range(1, 9))
    decode = [BatchRow([5], start_pos=3 + i, pages=pages) for i in range(3)]
    if kind == "decode":
        return decode
    if kind == "mixed":
        return decode + [BatchRow(list(range(6)), start_pos=10, pages=pages)]
    if kind == "prompt_logprobs":       # every token of the second row wants logits
        return [BatchRow([1, 2, 3], start_pos=0, pages=pages),
                BatchRow(list(range(5)), start_pos=0, pages=pages, logits_start=0)]
    if kind == "one_token":             # the only real entry is token index 0
        return [BatchRow([7], start_pos=0, pages=pages)]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["decode", "mixed", "prompt_logprobs", "one_token"])
@pytest.mark.parametrize("num_logits_pad", [None, 16])
def test_real_logits_rows_counts_the_entries_before_the_padding(kind, num_logits_pad):
    rows = _rows(kind)
    fb = build_flat_batch(rows, page_size=4, num_tokens_pad=16, num_rows_pad=8,
                          pages_per_seq_pad=8, num_logits_pad=num_logits_pad)
    want = fb.logits_row_spans[-1][1]
    assert want < len(fb.logits_indices)          # there is padding to skip
    got = jax.jit(real_logits_rows)(fb.logits_indices)
    assert int(got) == want
    np.testing.assert_array_equal(fb.logits_indices[want:], 0)
