"""Child of ``test_dp_attention_engine.test_dp8_on_eight_devices``: 8 simulated CPU devices
(the suite's process has 4), one engine per layout in ``sys.argv[2]`` (JSON ``[[tp, dp, ep],
...]``; dp 1: no DP attention) over the checkpoint ``sys.argv[1]``; prints ``{"tp,dp,ep":
[output ids per prompt]}`` as the last line."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from pdjax.engine.offline import Engine  # noqa: E402


def main():
    path, layouts, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    out = {}
    for tp, dp, ep in layouts:
        dp_args = dict(enable_dp_attention=True, dp_size=dp) if dp > 1 else {}
        eng = Engine(path, dtype="float32", page_size=8, max_total_tokens=1024,
                     max_running_requests=4, chunked_prefill_size=16, context_length=32,
                     enable_mixed_chunk=True, progress=False, tp_size=tp, ep_size=ep,
                     **dp_args)
        try:
            outs = eng.generate(input_ids=prompts, sampling_params={
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        finally:
            eng.shutdown()
        out[f"{tp},{dp},{ep}"] = [o["output_ids"] for o in outs]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
