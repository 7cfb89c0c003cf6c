"""Child of ``test_expert_parallel.test_tp8_on_eight_devices``: 8 simulated CPU devices (the
suite's process has 4), one engine per layout in ``sys.argv[2]`` (JSON ``[[tp, ep, backend],
...]``) over the checkpoint ``sys.argv[1]``; prints ``{"tp,ep,backend": [output ids per
prompt]}`` as the last line."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from pdjax.engine.offline import Engine  # noqa: E402


def main():
    path, layouts, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    out = {}
    for tp, ep, backend in layouts:
        eng = Engine(path, dtype="float32", page_size=8, max_total_tokens=512,
                     max_running_requests=4, chunked_prefill_size=16, context_length=32,
                     progress=False, tp_size=tp, ep_size=ep, moe_a2a_backend=backend)
        try:
            outs = eng.generate(input_ids=prompts, sampling_params={
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        finally:
            eng.shutdown()
        out[f"{tp},{ep},{backend}"] = [o["output_ids"] for o in outs]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
