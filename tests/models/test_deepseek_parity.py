"""DeepSeek-V3 / V3.2 / GLM-5 (pdjax, absorbed MLA over a paged latent cache) against
transformers on tiny random checkpoints made by transformers itself.

DSA parity is tested on prompts shorter than ``index_topk`` (the 4-head indexer configs, where
relu ties at 0 make the top-k order ambiguous once it selects) and on prompts up to 4x longer
than ``index_topk`` with 16 indexer heads, whose k-th/(k+1)-th index-score gap is asserted from
transformers' own scores (tie-free).
"""

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from mla_utils import PAGE, new_caches, prompts, run_rows
from model_utils import assign_pages
from pdjax.models.deepseek import DeepseekForCausalLM
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.loader import load_model
from pdjax.sched.batch import BatchRow

SHORT = (5, 13, 30)          # < index_topk = 32 of the 4-head configs
LONG = (9, 40, 64)           # index_topk = 16 of the 16-head configs


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _ours_prefill(model, ps, seed=0):
    caches = new_caches(model)
    pages = assign_pages([len(p) for p in ps], PAGE, 96, seed)
    rows = [BatchRow(p, 0, pg, logits_start=0) for p, pg in zip(ps, pages)]
    logits, _ = run_rows(model, rows, caches)
    return logits


def _hf_logits_and_index_scores(hf, p, index_topk):
    """transformers' logits for prompt ``p`` and the index scores its indexers ranked
    (captured at their ``topk`` call: ``[S, S]`` per full layer)."""
    captured = []
    original = torch.Tensor.topk

    def spy(self, k, *args, **kwargs):
        if self.dim() == 3 and k == min(index_topk, self.shape[-1]) and \
                self.shape[-1] == self.shape[-2] == len(p):
            captured.append(self[0].detach().clone())
        return original(self, k, *args, **kwargs)

    torch.Tensor.topk = spy
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([p])).logits[0].numpy()
    finally:
        torch.Tensor.topk = original
    return logits, captured


@pytest.mark.parametrize("name,lens", [("deepseek_v3", SHORT), ("deepseek_v32", SHORT),
                                       ("glm_moe_dsa", SHORT), ("deepseek_v32_long", LONG),
                                       ("glm_moe_dsa_long", LONG)])
def test_logits_match_transformers(tiny_checkpoints, name, lens):
    path = tiny_checkpoints[name]
    cfg, model = load_model(path, dtype="float32", progress=False)
    assert isinstance(model, DeepseekForCausalLM) and cfg.architecture == _hf(path).config.architectures[0]
    hf = _hf(path)
    ps = prompts(0, lens)
    ours = _ours_prefill(model, ps)
    for p, got in zip(ps, ours):
        ref, scores = _hf_logits_and_index_scores(hf, p, cfg.index_topk)
        assert got.shape == ref.shape
        err = np.abs(got - ref).max()
        assert err < 1e-4, (name, len(p), err)
        assert np.abs(ref).max() > 1.0        # a real signal, not near-uniform logits
        if cfg.has_indexer:
            assert len(scores) == len(cfg.full_indexer_layers)
        if len(p) > cfg.index_topk > 0:
            # Tie-free: every row choosing among more than k causal keys has a clear k-th gap.
            k = cfg.index_topk
            for s in scores:
                s = s.numpy()
                s = np.sort(np.where(s < -1e30, -np.inf, s), axis=-1)[:, ::-1]  # mask: finfo.min
                rows = np.isfinite(s[:, k])
                gaps = s[rows, k - 1] - s[rows, k]
                # Scores are O(1); the two implementations' hidden states differ by ~1e-6, so a
                # 2e-5 gap cannot flip the selection.
                assert rows.sum() == len(p) - k and gaps.min() > 2e-5, gaps.min()


def test_long_prompts_depend_on_the_sparse_selection(tiny_checkpoints):
    """The long DSA prompts exercise top-k: with index_topk raised past the prompt (dense MLA)
    the logits move far beyond the parity tolerance, so parity above is not vacuous."""
    cfg, model = load_model(tiny_checkpoints["glm_moe_dsa_long"], dtype="float32", progress=False)
    ps = prompts(0, LONG)                       # the parity batch: its executable is reused
    sparse = _ours_prefill(model, ps)[-1]
    model.cfg = dataclasses.replace(cfg, index_topk=4096)
    dense = _ours_prefill(model, ps)[-1]
    assert np.abs(sparse[: cfg.index_topk] - dense[: cfg.index_topk]).max() < 1e-4
    assert np.abs(sparse[cfg.index_topk + 8:] - dense[cfg.index_topk + 8:]).max() > 1e-2


def test_config_fields_from_checkpoints(tiny_checkpoints):
    v3 = DeepseekConfig.from_hf_dir(tiny_checkpoints["deepseek_v3"])
    assert v3.indexer_types == ("none",) * 3 and not v3.has_indexer
    assert v3.mlp_layer_types == ("dense", "sparse", "sparse") and v3.rope_interleave
    v32 = DeepseekConfig.from_hf_dir(tiny_checkpoints["deepseek_v32_long"])
    assert v32.indexer_types == ("full",) * 3 and not v32.indexer_rope_interleave
    assert (v32.index_topk, v32.index_n_heads, v32.index_head_dim) == (16, 16, 32)
    glm = DeepseekConfig.from_hf_dir(tiny_checkpoints["glm_moe_dsa"])
    assert glm.indexer_types == ("full", "shared", "full") and glm.indexer_rope_interleave
    assert glm.full_indexer_layers == (0, 2)
    assert dict(glm.rope_scaling)["rope_type"] == "yarn" and glm.latent_dim == 48
