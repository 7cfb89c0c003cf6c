"""PD with MTP speculative decoding (DESIGN.md §3, "Speculative decoding", PD): the prefill
server writes every prompt token's hidden state into its ``mtp_hidden`` cache buffer, which
travels with the KV pages, and the decode server drafts from its first step.

On the repeater checkpoint (``tests/mtp_checkpoint.py``, made from the tiny GLM-5) a draft is
accepted only when the MTP layer read the target's hidden state of the position before the
newest token; at the decode server's first step that position is the last prompt position,
computed on the prefill server. So an acceptance rate of exactly 1 on the decode server shows
the hidden states arrived (without them the first verify row of each request keeps nothing).
The output is the last prompt token repeated, as without speculation (requests opting out)."""

import pytest
from pd_harness import at_baseline, generate, get, metric_value, prefill_decode_router, wait_until

pytestmark = pytest.mark.slow

ARGS = dict(page_size=8, max_total_tokens=512, chunked_prefill_size=16, max_running_requests=2,
            context_length=64)
K = 4
SPEC = ["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", str(K),
        "--speculative-disable-adaptive"]


@pytest.fixture(scope="module")
def pd(tiny_checkpoints, tmp_path_factory):
    from mtp_checkpoint import write_repeater_checkpoint

    model = write_repeater_checkpoint(tiny_checkpoints["glm_moe_dsa"],
                                      str(tmp_path_factory.mktemp("pd_mtp") / "repeater"))
    logs = str(tmp_path_factory.mktemp("pd_mtp_logs"))
    with prefill_decode_router(model, logs, decode_name="decode_mtp", prefill_extra=SPEC,
                               decode_extra=SPEC, **ARGS) as servers:
        yield servers


def test_pd_decode_drafts_from_the_prefill_servers_hidden_states(pd):
    prompts = [[(11 * i + 5 * n) % 440 + 3 for i in range(n)] for n in (9, 17, 30)]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1 + 3 * K}
    verified = 0
    for ids in prompts:
        ref = generate(pd["router"], ids, {**greedy, "speculative": False})
        out = generate(pd["router"], ids, greedy)
        assert out["output_ids"] == ref["output_ids"] == [ids[-1]] * greedy["max_new_tokens"]
        assert "spec_verify_ct" not in ref["meta_info"]
        verified += out["meta_info"].get("spec_verify_ct", 0)
    assert verified >= 2 * len(prompts)
    status, text = get(pd["decode"].url + "/metrics")
    assert status == 200
    assert metric_value(text, "pdjax:spec_verify_rows_total") >= verified
    assert metric_value(text, "pdjax:spec_accept_rate") == 1.0
    wait_until(lambda: at_baseline(pd["decode"]) and at_baseline(pd["prefill"]), 30)
