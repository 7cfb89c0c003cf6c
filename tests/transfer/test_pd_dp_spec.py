"""Speculative decoding on a PD decode with DP attention (issue 41; DESIGN.md §3 "Speculative
decoding", §4, §6), tiny DeepSeek-V3.2, Mooncake, direct path: a TP 1 prefill writes each
request's pages into the shard of the rank a TP 4 DP 4 decode (4 simulated CPU devices)
assigned it, and the decode speculates from its first step: with n-gram drafts, and with MTP
drafts from the prompt's hidden states, which the prefill sends with the KV pages into the
same rank's shard of the decode's ``mtp_hidden`` buffer (page-sharded as the latent). The
decode's greedy tokens equal the colocated engine's decoding plainly (tie-aware), drafts are
accepted, and both pools are back at baseline after, with more requests in flight than ranks.

MTP runs on the repeater checkpoint (``tests/mtp_checkpoint.py``, made from the tiny GLM-5,
as tests/transfer/test_pd_mtp.py): a draft is accepted only when the MTP layer read the
target's hidden state of the position before the newest token, on the decode's first step the
last prompt position, computed on the prefill. An acceptance rate of exactly 1 shows each
request's hidden states landed on its rank's pages."""

import concurrent.futures

import pytest
from pd_harness import (at_baseline, child_env, free_port, get, greedy_agrees, load,
                        metric_value, pd_pair, pd_server, pd_state, running, wait_until)

pytestmark = pytest.mark.slow

# 148 pages, 37 a rank (test_pd_dp_attention.py says why not 32)
ARGS = dict(page_size=8, max_total_tokens=1184, chunked_prefill_size=16,
            max_running_requests=8, context_length=96)
DP = 4
NEW = 16
SAMPLING = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
K = 4
# drafts in steps of up to 8 decode rows (default 4): 6 requests decoding at once would
# otherwise verify nothing, depending on how their arrivals interleave
ROWS = ["--speculative-disable-by-batch-size", "8"]
MTP = ["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", str(K),
       "--speculative-disable-adaptive", *ROWS]
NGRAM = ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4",
         "--speculative-ngram-min-match-window-size", "1", *ROWS]


def _dp_flags(spec: list[str]) -> dict:
    return dict(tp_size=DP, extra=[
        "--enable-dp-attention", "--dp-size", str(DP), "--disaggregation-transfer-backend",
        "mooncake", "--disaggregation-transfer-path", "direct", *spec], env=child_env(
        XLA_FLAGS=f"--xla_cpu_multi_thread_eigen=false "
                  f"--xla_force_host_platform_device_count={DP}"))


@pytest.fixture(scope="module")
def ngram_pd(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_dp_ngram"))
    model = tiny_checkpoints["deepseek_v32"]
    from pdjax.engine import Engine

    colocated = Engine(model_path=model, progress=False, **ARGS)
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, **ARGS)
    decode = pd_server("decode_dp4_ngram", "decode", model, logs, **_dp_flags(NGRAM), **ARGS)
    try:
        with running([prefill, decode]):
            yield dict(prefill=prefill, decode=decode, bport=bport, colocated=colocated)
    finally:
        colocated.shutdown()


def _mtp_pair(tiny_checkpoints, tmp_path_factory, name, dp_side):
    """The MTP repeater checkpoint (from the tiny GLM-5) served by a PD pair whose
    ``dp_side`` ("decode" or "prefill") runs TP 4 DP 4, the other TP 1, and its colocated
    engine: a dict of prefill, decode, bport, colocated (a generator: the fixtures' body)."""
    from mtp_checkpoint import write_repeater_checkpoint

    model = write_repeater_checkpoint(tiny_checkpoints["glm_moe_dsa"],
                                      str(tmp_path_factory.mktemp(name) / "repeater"))
    logs = str(tmp_path_factory.mktemp(name + "_logs"))
    from pdjax.engine import Engine

    colocated = Engine(model_path=model, progress=False, **ARGS)
    bport = free_port()
    kw = {side: (_dp_flags(MTP) if side == dp_side else dict(extra=MTP))
          for side in ("prefill", "decode")}
    tp = {side: ("dp4" if side == dp_side else "tp1") for side in ("prefill", "decode")}
    prefill = pd_server(f"prefill_{tp['prefill']}_mtp", "prefill", model, logs,
                        bootstrap_port=bport, **kw["prefill"], **ARGS)
    decode = pd_server(f"decode_{tp['decode']}_mtp", "decode", model, logs, **kw["decode"],
                       **ARGS)
    try:
        with running([prefill, decode]):
            yield dict(prefill=prefill, decode=decode, bport=bport, colocated=colocated)
    finally:
        colocated.shutdown()


@pytest.fixture(scope="module")
def mtp_pd(tiny_checkpoints, tmp_path_factory):
    yield from _mtp_pair(tiny_checkpoints, tmp_path_factory, "pd_dp_mtp", "decode")


@pytest.fixture(scope="module")
def mtp_dp_prefill(tiny_checkpoints, tmp_path_factory):
    yield from _mtp_pair(tiny_checkpoints, tmp_path_factory, "pd_dp_mtp_p", "prefill")


def _repeating_prompts(lengths, salt):
    # a short pattern repeated: the n-gram drafter finds matches in the prompt
    pats = [[(13 * i + 7 * k + salt) % 400 + 3 for i in range(3 + k % 4)]
            for k in range(len(lengths))]
    return [(pat * 40)[:n] for pat, n in zip(pats, lengths)]


def _run_pd(pd, prompts, room0):
    ref = pd["colocated"].generate(input_ids=prompts, return_logprob=True,
                                   top_logprobs_num=2, sampling_params=SAMPLING)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(
            lambda kp: pd_pair(pd["prefill"], pd["decode"], pd["bport"], kp[1],
                               room0 + kp[0], NEW), enumerate(prompts)))
    compared = sum(greedy_agrees(r["output_ids"], r["meta_info"]["output_top_logprobs"],
                                 o["output_ids"]) for r, o in zip(ref, outs))
    assert compared >= 0.8 * NEW * len(prompts), compared
    return outs


def _back_at_baseline(pd):
    def ok():
        return all(at_baseline(s) and all(r["num_requests"] == r["num_pinned_pages"] == 0
                                           for r in load(s).get("dp_ranks", []))
                   for s in (pd["prefill"], pd["decode"]))
    assert wait_until(ok, 15), [load(pd[n]) for n in ("prefill", "decode")]


def test_ngram_decode_with_dp_attention(ngram_pd):
    """2 requests (ranks idle), then 6 (more than ranks): the colocated engine's tokens,
    verify rows on the DP decode from its first steps, drafts accepted, pools whole."""
    outs = _run_pd(ngram_pd, _repeating_prompts([11, 30], 0), 700)
    outs += _run_pd(ngram_pd, _repeating_prompts([9, 17, 24, 33, 41, 12], 1), 710)
    verified = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    assert verified >= len(outs), verified
    status, text = get(ngram_pd["decode"].url + "/metrics")
    assert status == 200
    assert metric_value(text, "pdjax:spec_verify_rows_total") >= verified
    assert metric_value(text, "pdjax:spec_accepted_tokens_total") > 0
    _back_at_baseline(ngram_pd)
    assert load(ngram_pd["decode"])["num_prompt_tokens_computed"] == 0


@pytest.mark.parametrize("pair", ["mtp_pd", "mtp_dp_prefill"])
def test_mtp_with_dp_attention(request, pair):
    """6 requests over 4 ranks: the colocated engine's tokens (the last prompt token
    repeated), every draft accepted, pools and ranks whole. ``mtp_pd``: TP 1 prefill -> DP 4
    decode (each rank read its requests' prefill hidden states); ``mtp_dp_prefill``: DP 4
    prefill -> TP 1 decode (each prompt's hidden states sent from its rank's shard)."""
    mtp_pd = request.getfixturevalue(pair)
    prompts = [[(11 * i + 5 * n) % 440 + 3 for i in range(n)] for n in (9, 17, 30, 12, 41, 24)]
    outs = _run_pd(mtp_pd, prompts, 800)
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == [ids[-1]] * NEW, out["output_ids"]
    verified = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    assert verified >= 2 * len(prompts), verified
    status, text = get(mtp_pd["decode"].url + "/metrics")
    assert status == 200
    assert metric_value(text, "pdjax:spec_accepted_tokens_total") > 0
    assert metric_value(text, "pdjax:spec_accept_rate") == 1.0
    _back_at_baseline(mtp_pd)
    assert load(mtp_pd["decode"])["num_prompt_tokens_computed"] == 0
    if pair == "mtp_dp_prefill":            # the prompts were computed on several ranks
        per_rank = ARGS["max_total_tokens"] // ARGS["page_size"] // DP
        recs = [r for r in pd_state(mtp_pd["prefill"])["recent"] if r["room"] >= 800]
        assert len(recs) == 6 and all(r["state"] == "Success" for r in recs), recs
        assert len({p // per_rank for r in recs for c in r["chunks"] for p in c["src"]}) >= 2
