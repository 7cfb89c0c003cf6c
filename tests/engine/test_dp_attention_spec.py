"""Speculative decoding and structured outputs under DP attention (issue 41 item 2; DESIGN.md
§3 "Speculative decoding", §6): tiny DeepSeek-V3.2 on 4 simulated CPU devices, TP 4 with
DP 4 (one device a rank) and DP 2 (two), with fewer requests than ranks and more.

With speculation (n-gram, MTP, a draft model) the greedy tokens equal those of the same
engine decoding plainly (requests opting out) and of TP 1 without DP attention, tie-aware
(DESIGN.md §5); drafts are accepted where they can be right; a verify row runs on its
request's rank (its draft pages are that rank's, ``KVCacheManager.alloc_free``), the MTP
layer reads its request's hidden states on that rank (every draft accepted on the repeater
checkpoint), and every page of the target's and the MTP layer's pools is back after
(``check_invariants``, the free counts after a cache flush). Prompt plus output stay within 32 tokens (the DSA
indexer's top-k of the tiny model), as in ``test_dp_attention_engine.py``.
"""

import json
import re

import jsonschema
import numpy as np
import pytest

from model_utils import (TINY_TOKENIZER_VOCAB, assert_speculation_keeps_tokens,
                         assert_tokens_match, top2_gaps_from_top_logprobs)
from pdjax.engine.offline import Engine

NEW = 16
ENGINE = dict(dtype="float32", page_size=8, max_total_tokens=1024, max_running_requests=4,
              chunked_prefill_size=16, context_length=32, enable_mixed_chunk=True,
              progress=False)
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def _prompts(lengths, seed):
    """Repetitive prompts (a short pattern repeated): n-gram drafts find matches at once."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        pat = rng.integers(3, TINY_TOKENIZER_VOCAB, int(rng.integers(2, 5))).tolist()
        out.append((pat * 16)[:n])
    return out


FEW = _prompts((12, 9), seed=1)                  # 2 requests: idle ranks under DP 4
MANY = _prompts((14, 10, 11, 16, 13), seed=2)    # 5 requests: more than the ranks, a queue


def _with_tops(eng, prompts):
    return eng.generate(input_ids=prompts, sampling_params={**GREEDY, "speculative": False},
                        return_logprob=True, top_logprobs_num=2)


@pytest.fixture(scope="module")
def tp1_outputs(tiny_checkpoints):
    """TP 1, no DP attention, no speculation: the reference of every layout."""
    eng = Engine(tiny_checkpoints["deepseek_v32"], **ENGINE)
    try:
        return {"few": _with_tops(eng, FEW), "many": _with_tops(eng, MANY)}
    finally:
        eng.shutdown()


def _check_vs_tp1(outs, refs, what):
    compared = 0
    for i, (o, r) in enumerate(zip(outs, refs)):
        gaps = top2_gaps_from_top_logprobs(r["meta_info"]["output_top_logprobs"])
        compared += assert_tokens_match(o["output_ids"], r["output_ids"], gaps,
                                        what=f"{what} request {i} vs TP 1")
    assert compared >= len(refs) * NEW // 2, f"{what}: only {compared} positions compared"


def _accepted(outs) -> tuple[int, int]:
    """(verify rows, drafts accepted) over ``outs``' meta_info."""
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    accepted = sum(round((o["meta_info"]["spec_accept_len"] - 1)
                         * o["meta_info"]["spec_verify_ct"])
                   for o in outs if o["meta_info"].get("spec_verify_ct"))
    return verify, accepted


def _check_pages_back(eng, dp):
    sched = eng.core.scheduler
    sched.check_invariants()
    assert eng.core.flush_cache()
    kv = sched.kv
    assert kv.allocator.num_free == kv.num_pages - dp          # each rank's null page aside
    assert [r["num_requests"] for r in kv.rank_load()] == [0] * dp


@pytest.fixture(scope="module", params=[(4, 4, 4), (4, 2, 1)], ids=["tp4dp4ep4", "tp4dp2"])
def ngram_engine(tiny_checkpoints, request):
    """``(engine, dp)``: TP 4 with DP attention and n-gram speculation (one per layout)."""
    tp, dp, ep = request.param
    eng = Engine(tiny_checkpoints["deepseek_v32"], tp_size=tp, ep_size=ep,
                 enable_dp_attention=True, dp_size=dp, speculative_algorithm="ngram",
                 speculative_num_draft_tokens=4, speculative_ngram_min_match_window_size=1,
                 **ENGINE)
    yield eng, dp
    eng.shutdown()


@pytest.mark.slow
def test_ngram_under_dp_attention(ngram_engine, tp1_outputs):
    """Slow: two engines compile (TP 1 once for the module; the DP one with verify rows)."""
    eng, dp = ngram_engine
    for name, prompts in (("few", FEW), ("many", MANY)):
        what = f"ngram dp{dp} {name}"
        out, _ = assert_speculation_keeps_tokens(eng, prompts, GREEDY, what)
        assert [len(o["output_ids"]) for o in out] == [NEW] * len(prompts)
        _check_vs_tp1(out, tp1_outputs[name], what)
        verify, accepted = _accepted(out)
        assert verify >= len(prompts) and accepted > 0, (what, verify, accepted)
        _check_pages_back(eng, dp)


REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)!", r"\([A-C]\) [a-z]{1,5}\."]
SCHEMAS = [{"type": "integer", "minimum": 100, "maximum": 999},
           {"enum": ["red", "green", "blue"]}]


@pytest.mark.slow
def test_structured_outputs_under_dp_attention(ngram_engine, tp1_outputs):
    """Grammar requests (regex, JSON schema; their masks go to their rows' logits in row
    order, and their verify rows' masks follow their drafts) on several ranks beside plain
    ones: each output matches its own grammar in full and ends there, and the plain requests
    keep TP 1's greedy tokens."""
    eng, dp = ngram_engine
    ids = eng.tokenizer.encode("Give me JSON:")
    params = ([{"max_new_tokens": 16, "temperature": 0, "regex": r} for r in REGEXES]
              + [{"max_new_tokens": 12, "temperature": 0, "json_schema": json.dumps(s)}
                 for s in SCHEMAS] + [GREEDY] * len(FEW))
    outs = eng.generate(input_ids=[ids] * 5 + FEW, sampling_params=params)
    for regex, out in zip(REGEXES, outs):
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}, out
    for schema, out in zip(SCHEMAS, outs[3:5]):
        jsonschema.validate(json.loads(out["text"]), schema)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}, out
    _check_vs_tp1(outs[5:], tp1_outputs["few"], f"dp{dp} plain beside grammar rows")
    _check_pages_back(eng, dp)


def _mtp_pool_whole(eng, dp):
    """The MTP drafter's own pool (a rank's share on each rank) is whole again."""
    drafter = eng.core.speculator.drafter
    assert drafter._state == {}
    assert drafter.allocator.num_free == drafter.allocator.num_pages - dp


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp,ep", [(4, 4, 4), (4, 2, 1)])
def test_mtp_under_dp_attention(tiny_checkpoints, tp1_outputs, tp, dp, ep):
    """MTP (the checkpoint's own next-n layer, run data-parallel as the target's layers, its
    pool split by rank): greedy tokens equal plain decoding's and TP 1's; verify rows ran on
    every request. The tiny random model's MTP layer rarely guesses right, so acceptance
    is asserted on the repeater checkpoint below."""
    eng = Engine(tiny_checkpoints["deepseek_v32"], tp_size=tp, ep_size=ep,
                 enable_dp_attention=True, dp_size=dp, speculative_algorithm="mtp",
                 speculative_num_draft_tokens=3, **ENGINE)
    try:
        for name, prompts in (("few", FEW), ("many", MANY)):
            what = f"mtp tp{tp} dp{dp} {name}"
            out, _ = assert_speculation_keeps_tokens(eng, prompts, GREEDY, what)
            assert [len(o["output_ids"]) for o in out] == [NEW] * len(prompts)
            _check_vs_tp1(out, tp1_outputs[name], what)
            assert all(o["meta_info"].get("spec_verify_ct", 0) > 0 for o in out), what
            _check_pages_back(eng, dp)
            _mtp_pool_whole(eng, dp)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_mtp_repeater_every_draft_accepted_under_dp_attention(tiny_checkpoints,
                                                              tmp_path_factory):
    """The repeater checkpoint (``tests/mtp_checkpoint.py``): every MTP draft is right only
    when the MTP layer reads the target's hidden state of the right position, which under DP
    attention lies on the request's rank's pages. 5 requests on 4 ranks, so every rank drafts
    (and one waits): every draft is accepted, each output is the last prompt token."""
    from mtp_checkpoint import write_repeater_checkpoint

    path = write_repeater_checkpoint(tiny_checkpoints["deepseek_v32"],
                                     str(tmp_path_factory.mktemp("repeater") / "dsv32"))
    K, dp = 3, 4
    eng = Engine(path, tp_size=4, ep_size=4, enable_dp_attention=True, dp_size=dp,
                 speculative_algorithm="mtp", speculative_num_draft_tokens=K,
                 speculative_disable_adaptive=True, **ENGINE)
    try:
        rng = np.random.default_rng(7)
        prompts = [rng.integers(3, TINY_TOKENIZER_VOCAB, n).tolist() for n in (9, 17, 5, 12, 20)]
        sp = {**GREEDY, "max_new_tokens": 1 + 3 * K}
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        for p, o in zip(prompts, out):
            assert o["output_ids"] == [p[-1]] * sp["max_new_tokens"]
        stats = eng.core.speculator.stats
        assert stats.num_verify_rows >= 3 * len(prompts) - 1
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        _check_pages_back(eng, dp)
        _mtp_pool_whole(eng, dp)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_draft_model_under_dp_attention(tiny_checkpoints, tp1_outputs):
    """A draft model (``--speculative-algorithm draft``: its own runner on one device, its
    own pool, nothing of the target's ranks) under DP 4: the target itself as the draft, so
    its greedy drafts are right; tokens equal plain decoding's and TP 1's."""
    path = tiny_checkpoints["deepseek_v32"]
    dp = 4
    eng = Engine(path, tp_size=4, ep_size=4, enable_dp_attention=True, dp_size=dp,
                 speculative_algorithm="draft", speculative_draft_model_path=path,
                 speculative_num_draft_tokens=3, **ENGINE)
    try:
        for name, prompts in (("few", FEW), ("many", MANY)):
            what = f"draft dp{dp} {name}"
            out, _ = assert_speculation_keeps_tokens(eng, prompts, GREEDY, what)
            _check_vs_tp1(out, tp1_outputs[name], what)
            verify, accepted = _accepted(out)
            assert verify >= len(prompts) and accepted > verify, (what, verify, accepted)
            _check_pages_back(eng, dp)
    finally:
        eng.shutdown()
