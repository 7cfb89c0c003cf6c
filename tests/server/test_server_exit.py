"""``python -m pdjax.serve`` leaves through ``exit_process``: no interpreter teardown, nothing
lost."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("initialize_distributed", [False, True],
                         ids=["one_process", "jax_distributed"])
def test_exit_process_flushes_and_keeps_the_code(initialize_distributed):
    """``pdjax.serve.exit_process`` skips the interpreter's teardown but loses nothing a
    server wrote: a line printed to a block-buffered pipe and a log record both arrive, the
    exit code is the one given, and a process in ``jax.distributed`` (a one-process cluster
    here) leaves it first, as the teardown would have."""
    script = (
        "import logging, sys\n"
        "from pdjax.serve import exit_process\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO)\n"
        "import jax\n"
        + ("from pdjax.ports import free_port\n"
           "jax.distributed.initialize(f'127.0.0.1:{free_port()}', 1, 0)\n"
           "assert jax.distributed.is_initialized()\n"
           "leave = jax.distributed.shutdown\n"
           "def shutdown():\n"
           "    print('left jax.distributed')\n"
           "    leave()\n"
           "jax.distributed.shutdown = shutdown\n" if initialize_distributed else "")
        + "print('stdout line')\n"
        "logging.getLogger('pdjax.test').info('log line')\n"
        "exit_process(3)\n"
        "print('never')\n")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("PYTHONUNBUFFERED", None)          # stdout to a pipe is then block-buffered
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    want = ["stdout line"] + (["left jax.distributed"] if initialize_distributed else [])
    assert proc.stdout.splitlines() == want
    assert "log line" in proc.stderr
