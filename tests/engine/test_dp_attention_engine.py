"""``--enable-dp-attention --dp-size`` through ``pdjax.Engine`` and the serve flags: tiny
DeepSeek-V3.2 and GLM-5 with attention and the DSA indexer data-parallel over the ranks of
the TP group (each rank its own requests and KV pages, the MLPs over every rank's tokens, TP
or EP) give transformers' greedy tokens (tie-aware) and TP 1's, with fewer requests than
ranks (idle ranks run empty segments) and mixed steps (``enable_mixed_chunk``: a prompt's
later chunk beside other ranks' decode rows); a layout or setting DP attention cannot serve
is one ``error: FIELD: ...`` line at parse time.

The suite's process has 4 simulated devices; DP 8 runs in a child process with 8
(``eight_devices.py``). DP attention replicates the attention weights, so the 4-head tiny
checkpoints run at TP 8 as they are."""

import numpy as np
import pytest
import torch
import transformers

from eight_devices import generate_on_eight_devices
from model_utils import assert_tokens_match, hf_greedy, top2_gaps
from pdjax.engine.offline import Engine
from pdjax.serve import parse_args

NEW = 8


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, n).tolist() for n in (5, 21, 13)]


_ENGINE = dict(dtype="float32", page_size=8, max_total_tokens=1024, max_running_requests=4,
               chunked_prefill_size=16, context_length=32, enable_mixed_chunk=True,
               progress=False)


def _generate(path, prompts, **kwargs):
    """Greedy outputs; prompt + output stay under index_topk (32), so the DSA indexer's
    ties at 0 cannot select differently (test_fp8.py's setting)."""
    eng = Engine(path, **_ENGINE, **kwargs)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0)
        _LAST["load"], _LAST["dp_gather_bytes"] = eng.core.get_load(), eng.core.dp_gather_bytes
        _LAST["cfg"] = eng.core.model_cfg
    finally:
        eng.shutdown()
    prompt_lps = [o["meta_info"]["input_token_logprobs"][1:] for o in outs]
    return [o["output_ids"] for o in outs], prompt_lps


_LAST = {}      # the last engine's get_load(), DP gather bytes and run config


def _check(outs, hf, prompts, what, tp1):
    compared = 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, logits = hf_greedy(hf, p, NEW, eos_token_id=None, pad_token_id=0)
        gaps = top2_gaps(logits)
        compared += assert_tokens_match(out, ref, gaps, what=f"{what} vs transformers")
        assert_tokens_match(out, tp1[i], gaps, what=f"{what} vs TP 1")
    assert compared >= 3 * NEW // 2, f"{what}: only {compared} positions compared"


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,dp,ep", [
    ("deepseek_v32", 4, 4, 4),      # 3 requests on 4 ranks; EP 4
    ("glm_moe_dsa", 4, 2, 1),       # 2 ranks of 2 devices; experts split by width
])
def test_dp_attention_matches_transformers_and_tp1(tiny_checkpoints, name, tp, dp, ep):
    """Slow: two engines compile (the DP one about 80 s cold on this CPU)."""
    prompts = _prompts()
    path = tiny_checkpoints[name]
    tp1, tp1_lps = _generate(path, prompts)
    assert _LAST["dp_gather_bytes"] == 0 and "dp_ranks" not in _LAST["load"]
    outs, lps = _generate(path, prompts, tp_size=tp, ep_size=ep, enable_dp_attention=True,
                          dp_size=dp)
    # /get_load per rank: finished requests hold nothing; their full pages stay cached on the
    # ranks that ran them (least loaded: 3 requests on ranks 0, 1, 2, or 2 ranks for dp 2)
    ranks = _LAST["load"]["dp_ranks"]
    assert [r["num_requests"] for r in ranks] == [0] * dp
    used = [r["num_used_pages"] for r in ranks]
    assert all(u > 0 for u in used[:min(dp, 3)]) and (dp < 4 or used[3] == 0), used
    # 129 pages (1024 tokens of 8, and a null page): 129 // dp a rank, each less its null page
    assert _LAST["load"]["num_total_pages"] == dp * (129 // dp) - dp
    cfg = _LAST["cfg"]
    per_token = (2 * cfg.num_layers + 1) * (tp - 1) * cfg.hidden_size * 4
    assert _LAST["dp_gather_bytes"] > 0 and _LAST["dp_gather_bytes"] % per_token == 0
    _check(outs, _hf(path), prompts, f"{name} tp{tp} dp{dp} ep{ep}", tp1)
    # prompt logprobs: every prompt position (chunked: the 21-token prompt's two chunks)
    for ref, got, p in zip(tp1_lps, lps, prompts):
        assert len(got) == len(p) - 1
        np.testing.assert_allclose(got, ref, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name,layouts", [
    ("deepseek_v32", [[8, 8, 8, "none"], [8, 8, 8, "ragged"]]),
    ("glm_moe_dsa", [[8, 8, 1, "none"], [8, 4, 4, "none"], [8, 8, 8, "ragged"],
                     [8, 4, 4, "ragged"]]),
])
def test_dp8_on_eight_devices(tiny_checkpoints, name, layouts):
    """TP 8 with DP attention 8 (3 requests: 5 idle ranks) and DP 4 of 2 devices, EP 8 /
    EP 4 / experts by width, dispatch none or ragged (from each rank's own tokens), against
    transformers and TP 1 (in the same child)."""
    prompts = _prompts(8)
    path = tiny_checkpoints[name]
    outs = generate_on_eight_devices(path, {
        f"{tp},{dp},{ep},{backend}": dict(
            _ENGINE, tp_size=tp, ep_size=ep, moe_a2a_backend=backend,
            **(dict(enable_dp_attention=True, dp_size=dp) if dp > 1 else {}))
        for tp, dp, ep, backend in [[1, 1, 1, "none"], *layouts]}, prompts, NEW)
    hf = _hf(path)
    tp1 = outs.pop("1,1,1,none")
    for layout, got in outs.items():
        _check(got, hf, prompts, f"{name} tp,dp,ep,backend {layout}", tp1)


# --------------------------------------------------------------------------- parse time

def _parse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "0", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("model,argv,message", [
    ("deepseek_v32", ["--tp-size", "4", "--enable-dp-attention", "--dp-size", "3"],
     "error: dp_size: 3 must divide tp_size (4)"),
    ("deepseek_v32", ["--tp-size", "4", "--dp-size", "2"],
     "error: dp_size: 2 ranks need enable_dp_attention"),
    ("deepseek_v32", ["--tp-size", "4", "--enable-dp-attention"],
     "error: enable_dp_attention: needs dp_size > 1"),
    ("llama", ["--tp-size", "2", "--enable-dp-attention", "--dp-size", "2"],
     "error: enable_dp_attention: llama models cannot use DP attention"),
    ("deepseek_v32", ["--tp-size", "2", "--enable-dp-attention", "--dp-size", "2",
                      "--speculative-algorithm", "draft", "--role", "decode",
                      "--speculative-draft-model-path", "MODEL"],
     "error: speculative_algorithm: 'draft' is not built for a decode with DP attention yet"),
    ("deepseek_v32", ["--tp-size", "4", "--enable-dp-attention", "--dp-size", "4",
                      "--max-total-tokens", "24", "--page-size", "8"],
     "error: max_total_tokens: 24 tokens give each of the 4 DP attention ranks fewer than 2"),
])
def test_layouts_refused_at_parse_time(tiny_checkpoints, capsys, model, argv, message):
    argv = [tiny_checkpoints[model] if a == "MODEL" else a for a in argv]
    err = _parse_error(capsys, ["--model-path", tiny_checkpoints[model], *argv])
    assert err.startswith(message), err


def test_flags_parse(tiny_checkpoints):
    args = parse_args(["--port", "0", "--model-path", tiny_checkpoints["deepseek_v32"],
                       "--tp-size", "4", "--ep-size", "4", "--enable-dp-attention",
                       "--dp-size", "4"])
    assert (args.enable_dp_attention, args.dp_size, args.ep_size) == (True, 4, 4)
    args = parse_args(["--port", "0", "--model-path", tiny_checkpoints["deepseek_v32"],
                       "--tp-size", "4", "--ep-size", "4", "--moe-a2a-backend", "ragged",
                       "--enable-dp-attention", "--dp-size", "4"])
    assert (args.moe_a2a_backend, args.dp_size, args.ep_size) == ("ragged", 4, 4)
    args = parse_args(["--port", "0", "--model-path", tiny_checkpoints["deepseek_v32"],
                       "--tp-size", "4", "--enable-dp-attention", "--dp-size", "2",
                       "--speculative-algorithm", "mtp"])
    assert (args.dp_size, args.speculative_algorithm) == (2, "mtp")
    args = parse_args(["--port", "0", "--model-path", tiny_checkpoints["deepseek_v32"],
                       "--tp-size", "4", "--enable-dp-attention", "--dp-size", "4",
                       "--speculative-algorithm", "ngram", "--role", "decode"])
    assert (args.role, args.dp_size, args.speculative_algorithm) == ("decode", 4, "ngram")
    args = parse_args(["--port", "0", "--model-path", tiny_checkpoints["deepseek_v32"],
                       "--tp-size", "4", "--enable-dp-attention", "--dp-size", "4",
                       "--speculative-algorithm", "mtp", "--role", "prefill"])
    assert (args.role, args.speculative_algorithm) == ("prefill", "mtp")
