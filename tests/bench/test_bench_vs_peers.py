"""scripts/bench_vs_peers.py in its small mode: pdjax and transformers on the tiny Llama."""

import json
import os
import sys

import bench_vs_peers
import pytest

from bench_settings import TINY_FLAGS
from pdjax.models.loader import load_tokenizer

pytestmark = pytest.mark.slow      # a benchmark script's small mode (the full run only)


def test_bench_vs_peers_small(tiny_checkpoints, tmp_path):
    out = tmp_path / "vs_peers.json"
    result = bench_vs_peers.main(["--model-path", tiny_checkpoints["llama"], "--small",
                                  *TINY_FLAGS, "--scan-layers", "--output-file", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert list(result["workloads"]) == ["disjoint", "shared_prefix"]
    assert result["num_prompts"] == 4 and result["output_len"] == 8
    assert result["total_output_tokens"] == 4 * 8
    disjoint, shared = result["workloads"]["disjoint"], result["workloads"]["shared_prefix"]
    for w in (disjoint, shared):
        lens = w["input_lens"]
        assert lens == sorted(lens) and lens[0] >= 8 and lens[-1] == 40
        assert w["total_prompt_tokens"] == sum(lens)
        assert [r["system"] for r in w["rows"]] == [
            "pdjax Engine", "pdjax Engine --no-unroll-layers", "transformers generate"]
        pdjax, scanned, hf = w["rows"]
        assert hf["prompts_agreeing_exact"] == 4                  # transformers against itself
        assert pdjax["prompts_agreeing_tie_aware"] == 4
        assert scanned["prompts_agreeing_tie_aware"] == 4
        for r in w["rows"]:
            assert r["offline_s"] > 0 and r["single_stream_ms_per_token"] > 0
            assert abs(r["offline_output_tok_s"] - 32 / r["offline_s"]) < 1e-9
            assert len(r["load_average"]["before"]) == 3 and len(r["load_average"]["after"]) == 3
    # the shared-prefix workload shares most of its tokens, the disjoint one at most the head
    head = _template_head(load_tokenizer(tiny_checkpoints["llama"]))
    assert disjoint["shared_prefix_tokens"] <= 3 * (head + 3)
    assert shared["shared_prefix_tokens"] > sum(shared["input_lens"][:3]) // 2
    assert result["pdjax_compiles_after_warmup"] == 0
    assert result["pdjax_scanned_compiles_after_warmup"] == 0
    assert result["vllm_env"] == {}


def _template_head(tok) -> int:
    """Tokens every chat prompt starts with (the template before the user's message)."""
    def encode(text):
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(text)["input_ids"]

    a, b = encode("alpha"), encode("beta")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_chat_prompts_hit_the_target_lengths(tiny_checkpoints):
    tok = load_tokenizer(tiny_checkpoints["llama"])
    for shared_prefix in (False, True):
        prompts = bench_vs_peers.chat_prompts(tok, [20, 33, 64], shared_prefix=shared_prefix)
        assert [len(p) for p in prompts] == [20, 33, 64]
        if getattr(tok, "chat_template", None):
            assert prompts[0][-3:] == prompts[2][-3:]


def test_default_prompts_are_disjoint(tiny_checkpoints):
    """The default workload's 16 prompts (16-400 tokens): no prompt shares more than the chat
    template's head (and a word's first letters: the tiny tokenizer spells most words letter by
    letter) with another, so no prompt is a prefix of another (each was cut
    from the start of one text, 2,853 of SmolLM2's 3,343 prompt tokens a prefix of an earlier
    prompt, and pdjax's radix cache skipped them)."""
    tok = load_tokenizer(tiny_checkpoints["llama"])
    lengths = [int(n) for n in bench_vs_peers.np.linspace(16, 400, 16).round()]
    prompts = bench_vs_peers.chat_prompts(tok, lengths)
    head = _template_head(tok)
    lens = [len(p) for p in prompts]
    shortest = len(bench_vs_peers.chat_prompts(tok, [1])[0])     # template + one token
    assert lens == [max(shortest, lengths[0])] + lengths[1:]
    for i, p in enumerate(prompts):
        for q in prompts[:i]:
            common = next((n for n, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
            assert common <= head + 3, (len(q), len(p), common)   # a word's first letters
    assert bench_vs_peers.shared_prefix_tokens(prompts) <= 15 * (head + 3)
    shared = bench_vs_peers.chat_prompts(tok, lengths, shared_prefix=True)
    assert bench_vs_peers.shared_prefix_tokens(shared) > sum(lengths[:-1]) // 2


def test_shared_prefix_tokens_counts_the_longest_common_prefix():
    assert bench_vs_peers.shared_prefix_tokens([[1, 2, 3], [1, 2, 4, 5], [9], [1, 2, 4, 6]]) \
        == 0 + 2 + 0 + 3


def test_vllm_env_preloads_tcmalloc_and_iomp(tmp_path, monkeypatch):
    """vLLM runs as its CPU docs configure it: tcmalloc and the venv's libiomp5.so preloaded,
    its KV cache size and OpenMP threads set; a missing library is an error naming the flag."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    python = str(venv / "bin" / "python")
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_bytes(b"")
    monkeypatch.setattr(bench_vs_peers, "TCMALLOC_PATHS", (str(tmp_path / "none.so"),
                                                           str(tcmalloc)))
    with pytest.raises(SystemExit) as e:
        bench_vs_peers.parse_args(["--vllm-python", python])
    assert e.value.code == 2                       # no libiomp5.so in the venv yet
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    args = bench_vs_peers.parse_args(["--vllm-python", python, "--vllm-threads", "2"])
    env = bench_vs_peers.vllm_env(args)
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2",
                   "VLLM_CPU_KVCACHE_SPACE": "2",
                   "LD_PRELOAD": f"{tcmalloc}:{venv / 'lib' / 'libiomp5.so'}"}
    args = bench_vs_peers.parse_args(["--vllm-python", python, "--vllm-preload", "none"])
    assert "LD_PRELOAD" not in bench_vs_peers.vllm_env(args)
    with pytest.raises(SystemExit):
        bench_vs_peers.parse_args(["--vllm-python", python, "--vllm-preload",
                                   os.path.join(str(tmp_path), "missing.so")])


FAKE_VLLM = '''
import json, os
LOG = os.environ["FAKE_VLLM_LOG"]


def _log(*event):
    with open(LOG, "a") as f:
        f.write(json.dumps(event) + "\\n")


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, **kw):
        _log("init", kw["enable_prefix_caching"], kw["max_model_len"])

    def reset_prefix_cache(self):
        _log("reset")

    def generate(self, prompts, sp, use_tqdm):
        _log("generate", len(prompts), prompts[0]["prompt_token_ids"][0], sp.max_tokens)
        return [type("R", (), {"outputs": [type("C", (), {
            "token_ids": [p["prompt_token_ids"][0]] * sp.max_tokens})]}) for p in prompts]
'''


def test_vllm_worker_resets_the_prefix_cache_before_each_timed_run(tmp_path):
    """The vLLM worker (run against a stand-in ``vllm`` package): prefix caching on, a warm-up
    on the warm-up prompts, an empty prefix cache before every timed run (its warm-up seeded
    the cache with timed prompts before), each workload's tokens returned by name."""
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                   "    return {'prompt_token_ids': prompt_token_ids}\n")
    log = tmp_path / "calls.jsonl"
    job = {"workloads": {"disjoint": [[1, 5], [2, 6]], "shared_prefix": [[3, 7], [3, 7, 8]]},
           "warmup": [[9], [10]], "single": [2, 6], "output_len": 3, "context": 32,
           "dtype": "float32", "model": "m", "tokenizer": None}
    out = bench_vs_peers.run_peer(sys.executable, bench_vs_peers.VLLM_WORKER, job,
                                  {"PYTHONPATH": str(tmp_path / "fake"),
                                   "FAKE_VLLM_LOG": str(log)}, 60)
    assert out["output_ids"] == {"disjoint": [[1, 1, 1], [2, 2, 2]],
                                 "shared_prefix": [[3, 3, 3], [3, 3, 3]]}
    assert set(out["offline_s"]) == {"disjoint", "shared_prefix"}
    assert out["single_stream_ms_per_token"] is not None
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [["init", True, 32],
                     ["reset"], ["generate", 2, 9, 3],           # warm-up
                     ["reset"], ["generate", 2, 1, 3],           # disjoint
                     ["reset"], ["generate", 2, 3, 3],           # shared prefix
                     ["reset"], ["generate", 1, 2, 1],           # single stream, 1 token
                     ["reset"], ["generate", 1, 2, 3]]           # and output_len tokens


def test_llamacpp_worker_runs_each_workload(tmp_path):
    """The llama.cpp worker against a stand-in ``llama_cpp`` (generate yields the prompt's
    first id forever): each workload's tokens by name, ``output_len`` of them per prompt."""
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import itertools\n"
        "class Llama:\n"
        "    def __init__(self, **kw):\n"
        "        pass\n"
        "    def generate(self, ids, **kw):\n"
        "        return itertools.repeat(ids[0])\n")
    job = {"workloads": {"disjoint": [[1, 5], [2, 6]], "shared_prefix": [[3, 7]]},
           "warmup": [[9]], "single": [2, 6], "output_len": 2, "context": 32,
           "dtype": "float32", "gguf": "m.gguf", "threads": 2}
    out = bench_vs_peers.run_peer(sys.executable, bench_vs_peers.LLAMACPP_WORKER, job,
                                  {"PYTHONPATH": str(tmp_path / "fake")}, 60)
    assert out["output_ids"] == {"disjoint": [[1, 1], [2, 2]], "shared_prefix": [[3, 3]]}
    assert set(out["offline_s"]) == {"disjoint", "shared_prefix"}
