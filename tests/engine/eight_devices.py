"""Greedy outputs of engines on 8 simulated CPU devices, for the TP 8 tests of EP
(``test_expert_parallel``) and DP attention (``test_dp_attention_engine``): the suite's process
has 4 devices, so ``generate_on_eight_devices`` runs this file as a child process with 8.

The child builds one ``pdjax.Engine`` per run in turn, each over the same checkpoint with that
run's keyword arguments, generates ``max_new_tokens`` greedy tokens (EOS ignored) per prompt
and prints ``{label: [output ids per prompt]}`` as its last line.
"""

import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate_on_eight_devices(path: str, runs: dict[str, dict], prompts: list[list[int]],
                              max_new_tokens: int, timeout_s: float = 1500
                              ) -> dict[str, list[list[int]]]:
    """``{label: output ids per prompt}`` of an engine over checkpoint ``path`` built with
    ``runs[label]`` (``pdjax.Engine`` keyword arguments, JSON values) on 8 CPU devices, in a
    child process; ``AssertionError`` with the child's stderr tail when it fails."""
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, os.path.abspath(__file__), path, json.dumps(runs),
                          json.dumps(prompts), str(max_new_tokens)],
                         capture_output=True, text=True, env=env, timeout=timeout_s)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _main() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"   # before JAX loads
    from pdjax.engine.offline import Engine

    path, runs, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    max_new_tokens = int(sys.argv[4])
    out = {}
    for label, kwargs in runs.items():
        eng = Engine(path, **kwargs)
        try:
            outs = eng.generate(input_ids=prompts, sampling_params={
                "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True})
        finally:
            eng.shutdown()
        out[label] = [o["output_ids"] for o in outs]
    print(json.dumps(out))


if __name__ == "__main__":
    _main()
