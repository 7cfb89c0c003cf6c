"""Speculative decoding on the real SmolLM2-135M (the default model): greedy tokens equal those
of the same engine's plain decoding (a request opting out runs the decode entry, overlapped),
tie-aware (DESIGN.md §5), on a prompt the model copies from, with drafts accepted."""

import os

import pytest

from model_utils import assert_speculation_keeps_tokens
from pdjax.engine import Engine
from pdjax.runner.model_runner import compile_count

pytestmark = pytest.mark.slow      # slow tier: speculative decoding on the default 135M model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def smol_spec():
    eng = Engine(None, context_length=1024, max_running_requests=4, chunked_prefill_size=256,
                 progress=False, speculative_algorithm="ngram", speculative_num_draft_tokens=5)
    yield eng
    eng.shutdown()


def _copy_prompt(tok):
    with open(os.path.join(ROOT, "pdjax", "spec", "__init__.py")) as f:
        code = f.read()
    text = f"Repeat this Python file exactly.\n\n```python\n{code}```"
    chat = tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=False)
    return tok.encode(chat + "```python\n" + code.splitlines(keepends=True)[0],
                      add_special_tokens=False)


def test_smollm2_greedy_tokens_equal_with_speculation(smol_spec):
    tok = smol_spec.tokenizer
    prompts = [_copy_prompt(tok),
               tok.encode(tok.apply_chat_template(
                   [{"role": "user", "content": "What is a bicycle?"}],
                   add_generation_prompt=True, tokenize=False), add_special_tokens=False)]
    sp = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    before = compile_count()
    out, compared = assert_speculation_keeps_tokens(smol_spec, prompts, sp, what="smollm2")
    assert min(compared) >= 16, compared
    copy = out[0]["meta_info"]
    assert copy["spec_verify_ct"] > 0 and copy["spec_accept_len"] >= 2.5
    assert compile_count() == before
