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
     r"^top_logprobs_num: an integer, got '2'"),
    (dict(input_ids=[5], return_logprob=True, top_logprobs_num=-1),
     r"^top_logprobs_num must be >= 0, got -1"),
    (dict(input_ids=[5], return_logprob=True, logprob_start_len="a"),
     r"^logprob_start_len: an integer, got 'a'"),
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
