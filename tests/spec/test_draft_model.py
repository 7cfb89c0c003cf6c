"""The draft-model drafter (``--speculative-algorithm draft``, DESIGN.md §3 "Speculative
decoding"): greedy tokens equal plain decoding (tie-aware, DESIGN.md §5) on the tiny Llama
with itself as the draft (every draft accepted) and with another tiny checkpoint as the draft
(few accepted), and on the tiny DeepSeek-V3 (MLA) drafting for itself; rollback to the common
prefix frees exactly the pages past it and drafts as a fresh request would; every draft page
comes back; settings and vocabulary are checked."""

import argparse
import dataclasses

import numpy as np
import pytest

from model_utils import (TINY_TOKENIZER_VOCAB, assert_speculation_keeps_tokens,
                         assert_tokens_match,
                         top2_gaps_from_top_logprobs)
from pdjax.config import ServerArgs
from pdjax.engine import Engine
from pdjax.runner.model_runner import compile_count
from pdjax.spec.draft_model import DraftModelDrafter

pytestmark = pytest.mark.slow      # slow tier: draft-model speculation, two engines a test

PAGE = 8
K = 4                       # speculative_num_draft_tokens: the newest token + 3 drafts
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
ENGINE = dict(dtype="float32", page_size=PAGE, max_total_tokens=2048, max_running_requests=4,
              chunked_prefill_size=32, context_length=128, progress=False)


@dataclasses.dataclass
class _Req:
    rid: str
    all_ids: list


def _prompts(seed, lengths=(20, 37, 9, 45)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY_TOKENIZER_VOCAB, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    eng = Engine(tiny_checkpoints["llama"], **ENGINE)
    yield eng
    eng.shutdown()


def _spec_engine(target, draft):
    return Engine(target, **ENGINE, speculative_algorithm="draft",
                  speculative_draft_model_path=draft, speculative_num_draft_tokens=K,
                  speculative_disable_adaptive=True)


def _run_and_compare(reference, eng, prompts):
    """Generate on both; tokens equal (tie-aware); returns the speculative run's stats delta."""
    ref = reference.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                             top_logprobs_num=2)
    before = compile_count()
    out = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for o, r in zip(out, ref):
        gaps = top2_gaps_from_top_logprobs(r["meta_info"]["output_top_logprobs"])
        assert_tokens_match(o["output_ids"], r["output_ids"], gaps, what="draft model")
        assert len(o["output_ids"]) == len(r["output_ids"]) == GREEDY["max_new_tokens"]
    assert compile_count() == before, "the draft model compiled after warm-up"
    drafter = eng.core.speculator.drafter
    # Every draft page is back once the requests ended, and no state is left.
    assert drafter.allocator.num_free == drafter.runner.num_pages - 1
    assert drafter._state == {}
    return eng.core.speculator.stats


def test_same_model_as_draft_accepts_every_draft(tiny_checkpoints, reference):
    eng = _spec_engine(tiny_checkpoints["llama"], tiny_checkpoints["llama"])
    try:
        stats = dataclasses.replace(_run_and_compare(reference, eng, _prompts(1)))
        stats.accept_len_hist = dict(stats.accept_len_hist)     # a copy: greedy steps only
        # Seeded sampled requests: a draw depends on the seed and the position only
        # (DESIGN.md §3), so speculating or not gives the same tokens.
        sampled = [{"max_new_tokens": 16, "temperature": 0.8, "top_k": 50, "seed": 7 + i,
                    "ignore_eos": True} for i in range(3)]
        prompts = _prompts(6, lengths=(12, 30, 19))
        spec = eng.generate(input_ids=prompts, sampling_params=sampled)
        plain = eng.generate(input_ids=prompts,
                             sampling_params=[{**p, "speculative": False} for p in sampled])
        assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
        assert all(o["meta_info"].get("spec_verify_ct", 0) > 0 for o in spec)
    finally:
        eng.shutdown()
    full = stats.accept_len_hist.get(K, 0)
    # The draft is the target: a verify row keeps all K - 1 drafts (then the target's own
    # token), except where a near-tie flips an argmax or max_new_tokens left less room.
    assert stats.num_verify_rows >= 8
    assert full >= 0.8 * stats.num_verify_rows, stats.accept_len_hist
    assert stats.acceptance_rate >= 0.8


def test_other_model_as_draft_keeps_output(tiny_checkpoints, reference):
    eng = _spec_engine(tiny_checkpoints["llama"], tiny_checkpoints["llama_tied"])
    try:
        stats = _run_and_compare(reference, eng, _prompts(2))
    finally:
        eng.shutdown()
    assert stats.num_verify_rows > 0
    assert stats.acceptance_rate < 0.5          # random weights: drafts mostly rejected


def test_mla_model_drafting_for_itself(tiny_checkpoints):
    """The MLA family as the draft (its own latent KV pool): the tiny DeepSeek-V3 drafting
    for itself; the reference is the same engine with requests opting out."""
    path = tiny_checkpoints["deepseek_v3"]
    eng = _spec_engine(path, path)
    try:
        prompts = _prompts(5, lengths=(20, 37))
        before = compile_count()
        out, _ = assert_speculation_keeps_tokens(eng, prompts, GREEDY, what="MLA draft")
        assert [len(o["output_ids"]) for o in out] == [GREEDY["max_new_tokens"]] * len(prompts)
        assert compile_count() == before
        stats = eng.core.speculator.stats
        assert stats.num_verify_rows >= 6
        assert stats.accept_len_hist.get(K, 0) >= 0.8 * stats.num_verify_rows, \
            stats.accept_len_hist
        drafter = eng.core.speculator.drafter
        assert drafter.allocator.num_free == drafter.runner.num_pages - 1
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def drafter(tiny_checkpoints):
    d = DraftModelDrafter(tiny_checkpoints["llama"], target_vocab_size=_vocab(tiny_checkpoints),
                          num_pages=32, page_size=PAGE, max_running_requests=4,
                          context_length=128, chunked_prefill_size=16, dtype="float32")
    d.warmup()
    return d


def _vocab(tiny_checkpoints):
    from pdjax.models.loader import checkpoint_config

    return checkpoint_config(tiny_checkpoints["llama"]).vocab_size


def _used(d):
    return d.runner.num_pages - 1 - d.allocator.num_free


def test_rollback_truncates_and_drafts_as_fresh(drafter):
    d = drafter
    ids = _prompts(3, lengths=(22,))[0]
    req = _Req("a", ids)
    first = d.propose([req], [3])[0]
    assert len(first) == 3
    # KV of the 22 ids and of the first two drafts (the last draft is never fed): 24 tokens.
    assert d.cached_len("a") == 24 and _used(d) == 3

    # The target kept no draft and emitted its own token: the common prefix is the 22 ids,
    # the 23rd token is fed; 3 pages hold 23 tokens (the page of position 24 was freed).
    own = (first[0] + 1) % 500
    req.all_ids = ids + [own]
    one = d.propose([req], [1])[0]
    assert d.cached_len("a") == 23 and _used(d) == 3
    assert one == d.propose([_Req("fresh", list(req.all_ids))], [1])[0]
    d.release("fresh")

    # Keep one draft and a bonus: 24 + 1 ids, then 3 drafts over a page boundary.
    req.all_ids = ids + [own, one[0], 7]
    again = d.propose([req], [3])[0]
    assert d.cached_len("a") == 25 + 2 and _used(d) == 4
    fresh = d.propose([_Req("fresh", list(req.all_ids))], [3])[0]
    assert again == fresh and len(again) == 3
    # Batched: two requests at different lengths in one extend and decode forward.
    other = _prompts(4, lengths=(40,))[0]
    both = d.propose([_Req("b", other), _Req("fresh", list(req.all_ids))], [3, 2])
    assert both[1] == fresh[:2]
    assert both[0] == d.propose([_Req("c", list(other))], [3])[0]

    for rid in ("a", "b", "c", "fresh"):
        d.release(rid)
    assert _used(d) == 0 and d._state == {}


def test_pool_exhaustion_drafts_nothing(drafter):
    d = drafter
    # 31 usable pages of 8: 120 ids and a draft fed back take 16 pages, reserved up front;
    # the second and third requests find too few and draft nothing (none starts a prompt).
    reqs = [_Req(f"x{i}", _prompts(10 + i, lengths=(120,))[0]) for i in range(3)]
    out = d.propose(reqs, [2, 2, 2])
    assert len(out[0]) == 2 and out[1] == out[2] == []
    assert d.cached_len("x0") == 121 and d.cached_len("x1") == d.cached_len("x2") == 0
    assert _used(d) == 16
    for r in reqs:
        d.release(r.rid)
    assert _used(d) == 0


def test_vocabulary_and_settings_checked(tiny_checkpoints):
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        DraftModelDrafter(tiny_checkpoints["llama_tied"],
                          target_vocab_size=_vocab(tiny_checkpoints) + 1, num_pages=8,
                          page_size=PAGE, max_running_requests=1, context_length=32,
                          chunked_prefill_size=16, dtype="float32")
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        ServerArgs(model_path=tiny_checkpoints["llama"], speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        ServerArgs(model_path=tiny_checkpoints["llama"], speculative_algorithm="ngram",
                   speculative_draft_model_path=tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="^speculative_algorithm: 'draft' with nnodes > 1"):
        ServerArgs(model_path=tiny_checkpoints["llama"], speculative_algorithm="draft",
                   speculative_draft_model_path=tiny_checkpoints["llama"], nnodes=2,
                   dist_init_addr="127.0.0.1:5000")
    args = ServerArgs(model_path=tiny_checkpoints["llama"], speculative_algorithm="draft",
                      speculative_draft_model_path=tiny_checkpoints["llama_tied"])
    assert args.speculative_draft_model_path == tiny_checkpoints["llama_tied"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cli = ServerArgs.from_cli_args(parser.parse_args(
        ["--model-path", tiny_checkpoints["llama"], "--speculative-algorithm", "draft",
         "--speculative-draft-model-path", tiny_checkpoints["llama_tied"]]))
    assert cli.speculative_draft_model_path == tiny_checkpoints["llama_tied"]
