"""scripts/bench_vs_peers.py in its small mode: pdjax and transformers on the tiny Llama."""

import json

import bench_vs_peers

from bench_settings import TINY_FLAGS
from pdjax.models.loader import load_tokenizer


def test_bench_vs_peers_small(tiny_checkpoints, tmp_path):
    out = tmp_path / "vs_peers.json"
    result = bench_vs_peers.main(["--model-path", tiny_checkpoints["llama"], "--small",
                                  *TINY_FLAGS, "--scan-layers", "--output-file", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["system"] for r in result["rows"]] == [
        "pdjax Engine", "pdjax Engine --no-unroll-layers", "transformers generate"]
    assert result["num_prompts"] == 4 and result["output_len"] == 8
    assert result["total_output_tokens"] == 4 * 8
    lens = result["input_lens"]
    assert lens == sorted(lens) and lens[0] >= 8 and lens[-1] == 40
    pdjax, scanned, hf = result["rows"]
    assert hf["prompts_agreeing_exact"] == 4                  # transformers against itself
    assert pdjax["prompts_agreeing_tie_aware"] == 4
    assert scanned["prompts_agreeing_tie_aware"] == 4
    for r in result["rows"]:
        assert r["offline_s"] > 0 and r["single_stream_ms_per_token"] > 0
        assert abs(r["offline_output_tok_s"] - 32 / r["offline_s"]) < 1e-9
    assert result["pdjax_compiles_after_warmup"] == 0
    assert result["pdjax_scanned_compiles_after_warmup"] == 0


def test_chat_prompts_hit_the_target_lengths(tiny_checkpoints):
    tok = load_tokenizer(tiny_checkpoints["llama"])
    prompts = bench_vs_peers.chat_prompts(tok, [20, 33, 64])
    assert [len(p) for p in prompts] == [20, 33, 64]
    if getattr(tok, "chat_template", None):
        assert prompts[0][-3:] == prompts[2][-3:]
