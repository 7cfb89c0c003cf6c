"""Speculative decoding on ``/metrics`` (names after SGLang's ``spec_accept_rate`` and
``spec_accept_length``), fed from the engine's ``SpecController.stats`` after every step.

    pdjax:spec_accept_rate                 gauge: accepted drafts / proposed drafts, 0..1
    pdjax:spec_accept_length               gauge: mean tokens a verify row emitted (>= 1)
    pdjax:spec_verify_rows_total           counter: verify rows run
    pdjax:spec_draft_tokens_total          counter: drafts proposed
    pdjax:spec_accepted_tokens_total       counter: drafts accepted
    pdjax:spec_verify_accept_length        histogram: tokens each verify row emitted
"""

from __future__ import annotations


def attach_spec_metrics(metrics, core) -> None:
    """Register the metrics above on ``metrics`` (a ``pdjax.metrics.Metrics``) and update them
    after each step of ``core`` (an ``EngineCore`` whose ``speculator`` is not None)."""
    spec = core.speculator
    width = spec.max_drafts + 1
    metrics.add_gauge("spec_accept_rate", "Accepted / proposed draft tokens since start, 0..1.")
    metrics.add_gauge("spec_accept_length", "Mean tokens emitted per verify row (accepted drafts "
                      "plus the target's own token) since start.")
    metrics.add_counter("spec_verify_rows", "Speculative verify rows run.")
    metrics.add_counter("spec_draft_tokens", "Draft tokens proposed.")
    metrics.add_counter("spec_accepted_tokens", "Draft tokens accepted.")
    metrics.add_histogram("spec_verify_accept_length", "Tokens emitted by one verify row.",
                          buckets=tuple(range(1, width + 1)))
    last = {"rows": 0, "drafts": 0, "accepted": 0, "hist": {}}

    def on_step(batch, outputs):
        s = spec.stats
        if s.num_verify_rows == last["rows"]:
            return
        metrics.spec_verify_rows.inc(s.num_verify_rows - last["rows"])
        metrics.spec_draft_tokens.inc(s.num_draft_tokens - last["drafts"])
        metrics.spec_accepted_tokens.inc(s.num_accepted_tokens - last["accepted"])
        for n, count in s.accept_len_hist.items():
            for _ in range(count - last["hist"].get(n, 0)):
                metrics.spec_verify_accept_length.observe(n)
        metrics.spec_accept_rate.set(s.acceptance_rate)
        metrics.spec_accept_length.set(s.mean_accept_len)
        last.update(rows=s.num_verify_rows, drafts=s.num_draft_tokens,
                    accepted=s.num_accepted_tokens, hist=dict(s.accept_len_hist))

    core.step_hooks.append(on_step)
