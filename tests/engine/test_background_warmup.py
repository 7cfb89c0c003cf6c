"""Lazy warm-up: the server compiles the core shapes before it is ready and the
rest on a background thread. A request arriving before the background set is done runs on a
larger compiled shape: same tokens as a fully warmed engine, and no compile on the request
path, then or after the background set completes."""

import re
import threading

import jax
import pytest

from model_utils import assert_tokens_match, boundary_prompts, top2_gaps_from_top_logprobs
from pdjax.engine import Engine
from pdjax.runner.model_runner import ModelRunner, background_compile_count, compile_count

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PAGE, CHUNK = 8, 64          # as the llama_engine fixture (tests/engine/conftest.py)


def _lazy_engine(tiny_checkpoints):
    return Engine(tiny_checkpoints["llama"], dtype="float32", page_size=PAGE, max_total_tokens=4096,
                  max_running_requests=16, chunked_prefill_size=CHUNK, context_length=128,
                  progress=False, background_compile=True)


def _hold_background_compile(monkeypatch) -> threading.Event:
    """Hold every engine's background compile thread at its start until the returned event
    is set."""
    gate = threading.Event()
    compile_rest = ModelRunner._compile_in_background

    def gated(self, *args):
        gate.wait(600)
        compile_rest(self, *args)

    monkeypatch.setattr(ModelRunner, "_compile_in_background", gated)
    return gate


def _generate(engine, prompts, keys):
    hook = lambda batch, key, tokens, t: keys.append(key)     # noqa: E731
    engine.core.dispatch_hooks.append(hook)
    try:
        return engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                               top_logprobs_num=2, logprob_start_len=0)
    finally:
        engine.core.dispatch_hooks.remove(hook)


REGEX = r"[0-9]{3}-[a-z]{2,4}"


def _grammar(engine):
    """Two regex requests: grammar rows are drawn by the resample executables (overlap)."""
    outs = engine.generate(["a", "b"], [{"max_new_tokens": 30, "temperature": 0, "regex": REGEX},
                                        {"max_new_tokens": 30, "temperature": 0.8, "seed": 3,
                                         "regex": REGEX}])
    for o in outs:
        assert re.fullmatch(REGEX, o["text"]), o["text"]


def _assert_same(ref, outs, what):
    for i, (a, b) in enumerate(zip(ref, outs)):
        gaps = top2_gaps_from_top_logprobs(a["meta_info"]["output_top_logprobs"])
        assert_tokens_match(b["output_ids"], a["output_ids"], gaps, what=f"{what} prompt {i}")
        pa = a["meta_info"]["input_token_logprobs"][1:]
        pb = b["meta_info"]["input_token_logprobs"][1:]
        assert len(pa) == len(pb) > 0 and max(abs(x - y) for x, y in zip(pa, pb)) < 1e-4, what


@pytest.mark.slow      # compiles every bucket in the background: a heavy engine check
def test_requests_before_and_after_background_warmup(tiny_checkpoints, llama_engine, monkeypatch):
    prompts = boundary_prompts(6, seed=11)
    ref = _generate(llama_engine, prompts, [])
    # Shapes an earlier engine of this process lowered come from JAX's in-memory cache and
    # lower nothing (the background count below would not move): start from an empty cache.
    jax.clear_caches()

    # Hold the background thread at its start: requests arrive before any of its shapes.
    gate = _hold_background_compile(monkeypatch)
    eng = _lazy_engine(tiny_checkpoints)
    runner, buckets = eng.core.runner, eng.core.buckets
    try:
        assert len(buckets.all_keys()) == 8
        assert runner.ready_keys == set(buckets.core_keys())
        load = eng.core.get_load()          # what /get_load shows (the benchmarks wait on it)
        assert (load["num_ready_buckets"], load["num_buckets"]) == (len(buckets.core_keys()), 8)
        before, before_bg = compile_count(), background_compile_count()
        keys = []
        outs = _generate(eng, prompts, keys)
        _assert_same(ref, outs, "before the background warm-up")
        splits = eng.core.num_grammar_split_steps
        _grammar(eng)
        assert eng.core.num_grammar_split_steps > splits
        assert compile_count() == before and background_compile_count() == before_bg
        assert runner.compiles_after_warmup == 0
        # Every batch ran on a core shape: decode padded to 16 rows, extend to 64 tokens.
        assert set(keys) == set(buckets.core_keys())

        gate.set()                     # requests while the background set compiles, then after
        during = _generate(eng, prompts, [])
        assert runner.wait_background(timeout_s=600)
        assert runner.ready_keys == set(buckets.all_keys())
        assert eng.core.get_load()["num_ready_buckets"] == 8
        keys = []
        after = _generate(eng, prompts, keys)
        _grammar(eng)                  # on the small decode shapes' resample executables
        for what, o in (("during the background warm-up", during), ("after it", after)):
            _assert_same(ref, o, what)
        # Prompt logprobs on the token buckets the background compiled: its jit cache serves.
        assert compile_count() == before and runner.compiles_after_warmup == 0
        assert background_compile_count() > before_bg
        assert {k.num_rows for k in keys if k.entry == "decode"} & {1, 2, 4, 8}
        assert {k.num_tokens for k in keys if k.entry == "extend"} & {16, 32}
    finally:
        gate.set()
        runner.wait_background(timeout_s=600)
        eng.shutdown()


def test_stop_background_waits_for_the_compile_in_flight(tiny_checkpoints, monkeypatch):
    """Shutdown joins the background thread: a compile still running when the interpreter
    exits aborts the process in XLA's C++ code ("terminate called ..."), seen on SIGTERM."""
    started, release = threading.Event(), threading.Event()
    compile_rest = ModelRunner._compile_in_background

    def in_flight(self, *args):         # a compile that is still running at shutdown
        started.set()
        release.wait(600)
        compile_rest(self, *args)

    monkeypatch.setattr(ModelRunner, "_compile_in_background", in_flight)
    eng = _lazy_engine(tiny_checkpoints)
    runner = eng.core.runner
    try:
        assert started.wait(60)
        threading.Timer(0.5, release.set).start()
        assert runner.stop_background(timeout_s=600)
        assert not runner._background.is_alive() and release.is_set()
        # Stopped before its first shape: only the core set was compiled.
        assert runner.ready_keys == set(eng.core.buckets.core_keys())
    finally:
        release.set()
        eng.shutdown()


@pytest.mark.slow      # compiles every bucket in the background: a heavy engine check
def test_speculative_verify_rows_never_compile(tiny_checkpoints, llama_engine, monkeypatch):
    """n-gram speculation on a lazily warmed engine (issue 33): verify rows run on the extend
    shapes warm-up compiled (the core one before the background set, the small ones after),
    with their wider logits rows; no compile on the request path; tokens as without."""
    prompts = [(p[:5] * 12)[:40] for p in boundary_prompts(4, seed=14)]
    greedy = {**GREEDY, "max_new_tokens": 12}
    ref = llama_engine.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True,
                                top_logprobs_num=2)
    gate = _hold_background_compile(monkeypatch)
    eng = Engine(tiny_checkpoints["llama"], dtype="float32", page_size=PAGE, max_total_tokens=4096,
                 max_running_requests=16, chunked_prefill_size=CHUNK, context_length=128,
                 progress=False, background_compile=True, speculative_algorithm="ngram",
                 speculative_num_draft_tokens=4, speculative_ngram_min_match_window_size=1)
    runner = eng.core.runner
    try:
        before = compile_count()
        for phase in ("core shapes only", "all shapes"):
            if phase == "all shapes":
                gate.set()
                assert runner.wait_background(timeout_s=600)
            keys = []
            hook = lambda batch, key, tokens, t: keys.append((key, batch))   # noqa: E731
            eng.core.dispatch_hooks.append(hook)
            try:
                outs = eng.generate(input_ids=prompts, sampling_params=greedy)
            finally:
                eng.core.dispatch_hooks.remove(hook)
            for a, b in zip(ref, outs):
                gaps = top2_gaps_from_top_logprobs(a["meta_info"]["output_top_logprobs"])
                assert_tokens_match(b["output_ids"], a["output_ids"], gaps, what=phase)
            verify_keys = {k for k, batch in keys if any(r.is_verify for r in batch.rows)}
            assert verify_keys and all(k.entry == "extend" for k in verify_keys), phase
            if phase == "all shapes":
                assert {k.num_tokens for k in verify_keys} & {16, 32}
        assert compile_count() == before and runner.compiles_after_warmup == 0
    finally:
        gate.set()
        runner.wait_background(timeout_s=600)
        eng.shutdown()
