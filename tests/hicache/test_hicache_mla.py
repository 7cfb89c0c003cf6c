"""The host tier moves every KV buffer a model has: the MLA latent (tiny DeepSeek-V3) and the
latent plus the DSA indexer's keys (tiny DeepSeek-V3.2). Prompts asked twice on an engine
whose device pool they overflow come back cached from the host, with the greedy tokens
(tie-aware) of an engine without the tier; a restarted engine reads them from the storage
tier. Slow: two engines per model compile heavily."""

import numpy as np
import pytest
from model_utils import assert_output_agrees

from pdjax.engine import Engine

pytestmark = pytest.mark.slow

SP = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("name,buffers", [("deepseek_v3", ["latent"]),
                                          ("deepseek_v32", ["latent", "indexer_k"])])
def test_the_host_tier_moves_mla_and_dsa_buffers(tiny_checkpoints, name, buffers, tmp_path):
    kw = dict(page_size=16, max_total_tokens=512, max_running_requests=4,
              chunked_prefill_size=256, context_length=320, progress=False)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 200, 200)] for _ in range(5)]
    plain = Engine(tiny_checkpoints[name], **kw)
    try:
        want = plain.generate(input_ids=prompts, sampling_params=SP, return_logprob=True,
                              top_logprobs_num=2)
    finally:
        plain.shutdown()
    store = dict(hicache_storage_backend="file",
                 hicache_storage_backend_extra_config=f'{{"path": "{tmp_path}"}}')
    tier = Engine(tiny_checkpoints[name], enable_hierarchical_cache=True, **kw, **store)
    try:
        assert sorted(s.name for s in tier.core.runner.cache_specs) == sorted(buffers)
        tier.generate(input_ids=prompts, sampling_params=SP)
        outs = tier.generate(input_ids=prompts, sampling_params=SP, return_logprob=True,
                             top_logprobs_num=2)
        for i, (w, o) in enumerate(zip(want, outs)):
            assert_output_agrees(w, o, f"{name} prompt {i}")
        # 5 x 13 pages over a 32-page device pool: the host served most of each prompt.
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [192] * 5
        assert tier.core.get_load()["hicache_hit_tokens"] >= 3 * 192
        tier.core.scheduler.check_invariants()
        tier.core.kv_worker.storage.flush()
    finally:
        tier.shutdown()
    # The storage tier (L3) holds the same buffers: a restarted engine reads them back.
    again = Engine(tiny_checkpoints[name], enable_hierarchical_cache=True, **kw, **store)
    try:
        outs = again.generate(input_ids=prompts, sampling_params=SP, return_logprob=True,
                              top_logprobs_num=2)
        for i, (w, o) in enumerate(zip(want, outs)):
            assert_output_agrees(w, o, f"{name} prompt {i}, from the store")
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [192] * 5
        load = again.core.get_load()
        assert load["hicache_storage_hit_tokens"] == 5 * 192
        assert load["hicache_storage_corrupt_pages"] == 0
    finally:
        again.shutdown()
