"""What one device must hold to serve, estimated from the settings and the model's config alone
(no model built, no tensor read), so that settings no device can hold are refused before
anything loads or allocates (``engine.settings.check_devices``, at parse time).

Every term is a lower bound (arrays that must exist at the same time, each split over ``tp``
as evenly as it can be), so the check refuses only what cannot fit; XLA's real peak is higher:

    weights        params of the config x param dtype / tp      (Llama family; 0 for MLA)
    KV pool        the cache buffers of ``num_pages`` pages      (``check_pool_fits``)
    row buffers    R rows: logits [R, V] float32 (a forward's output) and one more array of
                   that shape in the sampler (``device_sampler.sample``: its log-probabilities
                   output, allocated whether a row asks or not; a draw's cumsum) (/ tp),
                   the penalty tables [R + 1, V] int32 + bool (replicated)
    token buffers  T tokens: the residual and a layer's output [T, H], the queries
                   [T, Hq * D / tp] and the MLP's gate and up [T, I / tp], in the param dtype

with R = ``max_running_requests`` and T the largest bucket's tokens (the largest extend bucket
or the largest decode batch, one token per row).
"""

from __future__ import annotations

import dataclasses

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes one device needs, by part (see the module docstring); ``total`` is their sum."""

    weights: int
    kv_pool: int
    rows: int
    tokens: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.rows + self.tokens


def weight_bytes(model_cfg, tp_size: int, param_bytes: int) -> int:
    """Lower bound of one device's share of the weights of a Llama-family ``model_cfg``
    (``ModelConfig``: embeddings, LM head unless tied, attention and MLP projections; norms
    left out), ``param_bytes`` per element, everything split over ``tp_size``. An MLA config
    (``DeepseekConfig``) counts 0: its experts' layout is not estimated here."""
    if not hasattr(model_cfg, "num_kv_heads"):
        return 0
    c = model_cfg
    q, kv = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return (c.num_layers * per_layer + embed) * param_bytes // tp_size


def row_bytes(vocab_size: int, max_rows: int, tp_size: int) -> int:
    """Lower bound of the buffers of ``max_rows`` sampling rows on one device: the logits and
    one sampler array of their shape ``[R, V / tp]`` float32, the penalty tables
    ``[R + 1, V]`` int32 + bool (replicated)."""
    return 2 * max_rows * (-(-vocab_size // tp_size)) * 4 + (max_rows + 1) * vocab_size * 5


def token_bytes(model_cfg, max_tokens: int, tp_size: int, act_bytes: int) -> int:
    """Lower bound of the activations of a forward of ``max_tokens`` tokens on one device."""
    c = model_cfg
    queries = c.num_q_heads * getattr(c, "head_dim", getattr(c, "qk_head_dim", 0))
    # An MLA model whose layers are all MoE has no dense MLP: its experts' width instead.
    mlp = (c.moe_intermediate_size if getattr(c, "dense_layers", True) == ()
           else c.intermediate_size)
    width = 2 * c.hidden_size + (queries + 2 * mlp) // tp_size
    return max_tokens * width * act_bytes


def check_step_fits(need: StepMemory, limit: int | None, *, max_rows: int, max_tokens: int,
                    token_field: str, token_value: int) -> None:
    """``ValueError`` naming the setting whose buffers push ``need`` past ``limit`` bytes (a
    device's memory; None: unknown, not checked), weights and KV pool counted first:
    ``max_running_requests`` (the row buffers), else ``token_field`` (the setting
    ``token_value`` that makes a forward ``max_tokens`` tokens: ``chunked_prefill_size``,
    ``max_num_batched_tokens`` or ``max_running_requests``)."""
    if limit is None or need.total <= limit:
        return
    held = (f"with the weights ({need.weights / GIB:,.1f} GiB) and the KV pool "
            f"({need.kv_pool / GIB:,.1f} GiB), more than its {limit / GIB:,.1f} GiB")
    if need.weights + need.kv_pool + need.rows > limit:
        raise ValueError(f"max_running_requests: {max_rows:,} rows need at least "
                         f"{need.rows / GIB:,.1f} GiB of logits and penalty tables on each "
                         f"device, {held}")
    tokens = "" if token_value == max_tokens else f" ({max_tokens:,} tokens in a forward)"
    raise ValueError(f"{token_field}: {token_value:,}{tokens} needs at least "
                     f"{(need.rows + need.tokens) / GIB:,.1f} GiB of activations and logits on "
                     f"each device, {held}")
