"""The offline ``Engine`` and bad arguments: a ``top_k`` over int32 is a ``ValueError`` naming
it (the device's int32 array could not hold it), the largest seed with ``n`` samples wraps
below 2**63 instead of failing, and a prompt, token id or parameter of the wrong type is a
``ValueError`` naming the field (they were ``TypeError``s from deep inside), with nothing left
queued."""

import numpy as np
import pytest

PROMPT = [5, 17, 42, 99, 7]


def test_top_k_past_int32_is_refused_naming_it(llama_engine):
    for top_k in (2 ** 31, 10 ** 30):
        with pytest.raises(ValueError, match="top_k"):
            llama_engine.generate(input_ids=PROMPT,
                                  sampling_params={"max_new_tokens": 2, "top_k": top_k})
    assert not llama_engine.core.scheduler.has_work
    out = llama_engine.generate(input_ids=PROMPT, sampling_params={
        "max_new_tokens": 2, "temperature": 0, "top_k": 2 ** 31 - 1})
    assert len(out["output_ids"]) == 2


def test_largest_seed_with_n_samples(llama_engine):
    outs = llama_engine.generate(input_ids=[PROMPT], sampling_params={
        "max_new_tokens": 3, "seed": 2 ** 63 - 1, "n": 2})
    assert [len(o["output_ids"]) for o in outs] == [3, 3]


MAX2 = {"max_new_tokens": 2}


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt=123), r"^prompt: a string or a list of strings, got int 123"),
    (dict(prompt=[1, 2]), r"^prompt: .*got list \[1, 2\] \(token ids go in input_ids\)"),
    (dict(prompt=["a", 5]), r"^prompt: a string or a list of strings"),
    (dict(prompt=b"x"), r"^prompt: .*got bytes"),
    (dict(input_ids="abc"), r"^input_ids: a list of token ids or a list of such lists, got str"),
    (dict(input_ids=5), r"^input_ids: .*got int 5"),
    (dict(input_ids=[[]]), r"^input_ids\[0\]: the prompt is empty"),
    (dict(input_ids=[[5], 6]), r"^input_ids\[1\]: a list of token ids, got int 6"),
    (dict(input_ids=[5, "a"]), r"^input_ids\[1\]: a token id must be an integer, got str 'a'"),
    (dict(input_ids=[[5], [6, 1.5]]), r"^input_ids\[1\]\[1\]: .*got float 1.5"),
    (dict(input_ids=[True]), r"^input_ids\[0\]: .*got bool True"),
    (dict(input_ids=[-1]), r"^input_ids\[0\]: token id -1 is outside \[0, "),
    (dict(input_ids=[5], sampling_params="x"), r"^sampling_params: a dict of parameters, got str"),
    (dict(input_ids=[[5], [6]], sampling_params=[MAX2, 1]),
     r"^sampling_params: a dict of parameters, got int"),
    (dict(input_ids=[5], return_logprob=True, top_logprobs_num="2"),
     r"^top_logprobs_num must be an integer, got str '2'"),
    (dict(input_ids=[5], return_logprob=True, top_logprobs_num=-1),
     r"^top_logprobs_num must be in \[0, 20\], got -1"),
    (dict(input_ids=[5], return_logprob=True, logprob_start_len="a"),
     r"^logprob_start_len must be an integer, got str 'a'"),
])
def test_wrong_types_are_value_errors_naming_the_field(llama_engine, kwargs, message):
    kwargs.setdefault("sampling_params", MAX2)
    with pytest.raises(ValueError, match=message):
        llama_engine.generate(**kwargs)
    core = llama_engine.core
    assert not core.scheduler.has_work and not core.scheduler.requests


def test_numpy_token_ids_are_taken_as_lists(llama_engine):
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    # Same batch shapes on both sides: the tokens compare exactly.
    as_list = llama_engine.generate(input_ids=PROMPT, sampling_params=greedy)
    as_array = llama_engine.generate(input_ids=np.array(PROMPT, np.int64),
                                     sampling_params=greedy)
    as_lists = llama_engine.generate(input_ids=[PROMPT, PROMPT[:3]], sampling_params=greedy)
    rows = llama_engine.generate(input_ids=[np.array(PROMPT), np.array(PROMPT[:3], np.int32)],
                                 sampling_params=greedy)
    assert isinstance(as_array, dict) and len(rows) == 2
    assert as_array["output_ids"] == as_list["output_ids"]
    assert [r["output_ids"] for r in rows] == [o["output_ids"] for o in as_lists]


def test_a_pool_larger_than_the_device_is_refused_naming_max_total_tokens(tiny_checkpoints):
    """Before: a MemoryError from the page allocator's lists (no message), or XLA's
    out-of-memory on the pool's zeros, after the weights had loaded."""
    from pdjax.engine import Engine
    from pdjax.runner.model_runner import device_memory_bytes
    import jax

    memory = device_memory_bytes(jax.devices()[0])
    assert memory is not None and memory > 2 ** 30        # the host's RAM on CPU
    with pytest.raises(ValueError, match=r"^max_total_tokens: a KV pool of 100,000,000,0\d\d "
                                         r"tokens needs [\d,.]+ GiB on each device, more than"):
        Engine(tiny_checkpoints["llama"], dtype="float32", max_total_tokens=10 ** 11,
               context_length=128, progress=False)


# Issue 44 D: the offline Engine refuses what the HTTP server refuses (pdjax.input_checks),
# before anything is queued; each was accepted (or a TypeError / AttributeError) before.
CTX = 128                    # llama_engine's context_length
TOKENIZER_VOCAB = 448        # the tiny checkpoints' tokenizer (the model's vocabulary is 512)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(prompt=[]), ValueError, r"^prompt: an empty list"),
    (dict(input_ids=[]), ValueError, r"^input_ids: empty"),
    (dict(prompt=["ok", "a \ud800 b"]), ValueError,
     r"^prompt\[1\]: the text cannot be tokenized \(TypeError"),
    (dict(input_ids=[5], return_logprob="yes"), ValueError,
     r"^return_logprob must be a boolean, got str 'yes'"),
    (dict(input_ids=[5], return_logprob=1), ValueError, r"^return_logprob must be a boolean"),
    (dict(input_ids=[5, 6], return_logprob=True, logprob_start_len=2 ** 70), ValueError,
     r"^logprob_start_len must be in \[-1, 2147483647\], got 1180591620717411303424"),
    (dict(input_ids=[5, 6], return_logprob=True, logprob_start_len=2), ValueError,
     r"^logprob_start_len = 2 must be below the prompt length \(2\)"),
    (dict(input_ids=[5], return_logprob=True, top_logprobs_num=21), ValueError,
     r"^top_logprobs_num must be in \[0, 20\], got 21"),
    (dict(input_ids=[5] * 100, sampling_params={"max_new_tokens": 29}), ValueError,
     r"^max_new_tokens: this model's maximum context length is 128 tokens. However, you "
     r"requested 129 tokens \(100 in the prompt, 29 in the completion\)"),
    (dict(input_ids=[[5], [5] * 120], sampling_params={"max_new_tokens": 9}), ValueError,
     r"^max_new_tokens: .*you requested 129 tokens"),
    (dict(input_ids=[5], sampling_params={"max_new_tokens": 10 ** 6}), ValueError,
     r"^max_new_tokens: .*128 tokens"),
    (dict(input_ids=[5] * CTX, sampling_params=MAX2), ValueError,
     r"^input_ids: the prompt has 128 tokens, at or over the model's context length"),
    (dict(input_ids=[[5], [TOKENIZER_VOCAB]]), ValueError,
     r"^input_ids\[1\]\[0\]: token id 448 is outside \[0, 448\)"),
    (dict(input_ids=[5, 511]), ValueError, r"^input_ids\[1\]: token id 511 is outside"),
])
def test_offline_refuses_what_http_refuses(llama_engine, kwargs, error, message):
    kwargs.setdefault("sampling_params", MAX2)
    with pytest.raises(error, match=message):
        llama_engine.generate(**kwargs)
    core = llama_engine.core
    assert not core.scheduler.has_work and not core.scheduler.requests
    out = llama_engine.generate(input_ids=PROMPT, sampling_params={**MAX2, "temperature": 0})
    assert len(out["output_ids"]) == 2           # still serving


def test_offline_max_new_tokens_fits_or_defaults_to_the_context(llama_engine):
    """Up to the context's end is served as asked; the default (128) is cut to what the prompt
    leaves, and None runs to the context's end."""
    greedy = {"temperature": 0, "ignore_eos": True}
    prompt = [5] * 120
    out = llama_engine.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 8})
    assert len(out["output_ids"]) == 8
    for sp in (greedy, {**greedy, "max_new_tokens": None}):
        out = llama_engine.generate(input_ids=prompt, sampling_params=sp)
        assert len(out["output_ids"]) == CTX - 120
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": CTX - 120}


def test_generate_after_shutdown_is_a_runtime_error(tiny_checkpoints):
    from pdjax.engine import Engine

    eng = Engine(tiny_checkpoints["llama"], dtype="float32", page_size=8, max_total_tokens=256,
                 max_running_requests=2, chunked_prefill_size=16, context_length=32,
                 progress=False)
    assert len(eng.generate(input_ids=PROMPT, sampling_params=MAX2)["output_ids"]) == 2
    eng.shutdown()
    for call in (lambda: eng.generate(input_ids=PROMPT, sampling_params=MAX2),
                 lambda: eng.generate("hi")):
        with pytest.raises(RuntimeError, match=r"^this Engine was shut down"):
            call()
    eng.shutdown()               # a second shutdown is harmless


@pytest.mark.parametrize("kwargs,message", [
    (dict(context_length="128"), r"^context_length: must be an integer or null, got str '128'"),
    (dict(context_length=2 ** 70), r"^context_length: must be at most 9223372036854775807"),
    (dict(page_size=8.0), r"^page_size: must be an integer, got float 8.0"),
    (dict(max_running_requests=True), r"^max_running_requests: must be an integer, got bool"),
    (dict(enable_mixed_chunk="yes"), r"^enable_mixed_chunk: must be true or false, got str"),
    (dict(disable_radix_cache=1), r"^disable_radix_cache: must be true or false, got int 1"),
    (dict(served_model_name=5), r"^served_model_name: must be a string or null, got int 5"),
    (dict(random_seed="7"), r"^random_seed: must be an integer, got str '7'"),
    (dict(num_reserved_decode_tokens=-1), r"^num_reserved_decode_tokens: must be >= 0"),
    (dict(watchdog_timeout_s="10"), r"^watchdog_timeout_s: must be a number, got str"),
    (dict(progress="no"), r"^progress must be a boolean, got str 'no'"),
    (dict(background_compile=None), r"^background_compile must be a boolean"),
    (dict(buckets=[16, 32]), r"^buckets: a pdjax.sched.buckets.Buckets or None, got list"),
    (dict(model_path="/nonexistent"), r"^model_path: /nonexistent: model path not found"),
    (dict(tokenizer_path="/nonexistent"), r"^tokenizer_path: /nonexistent: not found"),
])
def test_engine_arguments_of_the_wrong_type_are_value_errors(tiny_checkpoints, kwargs, message):
    """Every ``Engine`` argument is checked before anything loads (``context_length="128"``
    was a ``TypeError`` from a comparison; ``"yes"`` for a flag was taken as true)."""
    from pdjax.engine import Engine

    kwargs.setdefault("model_path", tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match=message):
        Engine(dtype="float32", **kwargs)
