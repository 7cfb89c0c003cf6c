"""``python -m pdjax.serve --role pd``: prefill + decode children and the router in one command;
the children die with the parent, even when it is SIGKILLed."""

import os
import random
import signal
import sys
import time

import pytest
from pd_harness import TINY_ARGS, Server, child_env, free_port, post, wait_until

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_role_pd_serves_through_its_router_and_children_die_with_it(tiny_checkpoints,
                                                                     tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "pdjax.serve", "--role", "pd", "--model-path",
            tiny_checkpoints["llama"], "--port", str(port), "--skip-warmup-progress",
            "--disaggregation-bootstrap-port", str(free_port()),
            "--num-reserved-decode-tokens", "16"]
    for k, v in TINY_ARGS.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    pd = Server("pd", argv, port, str(tmp_path), child_env())
    kids: list[int] = []
    try:
        pd.wait_healthy()
        kids = _children(pd.proc.pid)
        assert len(kids) == 2 and all(_alive(k) for k in kids)
        rng = random.Random(3)
        ids = [rng.randrange(3, 440) for _ in range(29)]
        status, out = post(pd.url + "/generate", {
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 5}})
        assert status == 200 and len(out["output_ids"]) == 5, out
        os.kill(pd.proc.pid, signal.SIGKILL)
        pd.proc.wait(10)
        t0 = time.monotonic()
        assert wait_until(lambda: not any(_alive(k) for k in kids), 30), pd.log_tail()
        assert time.monotonic() - t0 < 30
    except BaseException:
        print(pd.log_tail(80))
        raise
    finally:
        pd.stop()
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)
