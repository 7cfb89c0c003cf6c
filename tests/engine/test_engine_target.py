"""Stall-free mixed batches on the real engine (tiny Llama): whatever chunk sizes the ITL
target picks, greedy tokens match the unmixed run tie-aware (DESIGN.md §5), output and prompt
logprobs agree within 1e-4, and nothing compiles after warm-up."""

import numpy as np

from model_utils import assert_output_agrees, boundary_prompts, set_sched
from pdjax.engine.forward import seed_cost_model
from pdjax.runner.model_runner import compile_count

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _run(engine, prompts, steps=None, logprob_start_len=3):
    """Generate; ``steps`` gets ``(forward_mode, [(num_tokens, is_decode) per row],
    predicted_time_s)`` per step, taken when the step is scheduled."""
    core = engine.core
    sched = core.scheduler
    schedule = sched.schedule

    def recording_schedule():
        batch = schedule()
        if batch is not None and steps is not None:
            steps.append((batch.forward_mode, [(r.num_tokens, r.is_decode) for r in batch.rows],
                          batch.predicted_time_s))
        return batch

    def hook(batch, outputs):
        sched.check_invariants()

    sched.schedule = recording_schedule
    core.step_hooks.append(hook)
    try:
        return engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                               top_logprobs_num=2, logprob_start_len=logprob_start_len)
    finally:
        core.step_hooks.remove(hook)
        del sched.schedule


def _assert_same(ref_outs, outs, what):
    for i, (a, b) in enumerate(zip(ref_outs, outs)):
        assert_output_agrees(a, b, f"{what} prompt {i}")
        if "input_token_logprobs" not in b["meta_info"]:
            continue
        pa = [x for x in a["meta_info"]["input_token_logprobs"] if x is not None]
        pb = [x for x in b["meta_info"]["input_token_logprobs"] if x is not None]
        assert len(pa) == len(pb) == len(ref_prompts[i]) - 3
        assert np.abs(np.array(pa) - np.array(pb)).max() < 1e-4, what


ref_prompts = boundary_prompts(12, seed=5, lengths=[8, 9, 16, 17, 15, 33, 49, 40, 55, 5, 31, 25])


def test_target_chunks_keep_greedy_tokens_and_compile_nothing(llama_engine):
    core = llama_engine.core
    set_sched(llama_engine, disable_radix_cache=True)          # chunk 64, mixed off
    ref = _run(llama_engine, ref_prompts)
    # Warm-up already compiled every bucket: seeding times one empty forward of each mixed one.
    num_mixed = len(core.buckets.token_buckets) * len(core.buckets.pages_per_seq_buckets)
    assert seed_cost_model(core.runner, core.buckets, core.cost_model) == num_mixed
    before = compile_count()

    # A target no step meets: every mixed step advances the prompt by one page plus the rest of
    # the token bucket that page needs (a prompt's last chunk may be shorter).
    set_sched(llama_engine, enable_mixed_chunk=True, disable_radix_cache=True, target_itl_ms=1e-3)
    steps = []
    _assert_same(ref, _run(llama_engine, ref_prompts, steps), "target 1 us")
    mixed = [rows for mode, rows, _ in steps if mode == "mixed"]
    assert len(mixed) >= 10
    page = core.args.page_size
    for rows in mixed:
        prefill = [n for n, is_decode in rows if not is_decode]
        n_decode = len(rows) - len(prefill)
        floor = min(b for b in core.buckets.token_buckets if b >= n_decode + page)
        assert len(prefill) == 1 and prefill[0] <= max(page, floor - n_decode), (rows, steps)
    assert all(p is not None for _, _, p in steps)              # the model had data throughout

    # A target between the smallest and the largest mixed step: chunk sizes vary.
    small = core.cost_model.predict("mixed", 16, 16, 4, 0)
    large = core.cost_model.predict("mixed", 64, 16, 4, 0)
    set_sched(llama_engine, enable_mixed_chunk=True, disable_radix_cache=True,
              target_itl_ms=1000 * (small + large) / 2)
    steps = []
    _assert_same(ref, _run(llama_engine, ref_prompts, steps), "target between")
    sizes = {sum(n for n, _ in rows) for mode, rows, _ in steps if mode == "mixed"}
    assert len(sizes) >= 2, sizes

    # And with the prefix cache (hits shorten the prompts; prompt logprobs would forbid them)
    # under the same target.
    set_sched(llama_engine, enable_mixed_chunk=True, target_itl_ms=1000 * (small + large) / 2)
    _run(llama_engine, ref_prompts, logprob_start_len=None)
    hit = _run(llama_engine, ref_prompts, logprob_start_len=None)
    assert sum(o["meta_info"]["cached_tokens"] for o in hit) > 0
    _assert_same(ref, hit, "target, prefix hits")
    assert compile_count() == before
