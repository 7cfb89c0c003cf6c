"""Suite-wide setup: 4 simulated CPU devices (TP tests), the persistent compilation cache,
tiny random Hugging Face checkpoints made once per session with transformers, and JAX's
in-memory executables released after every test module."""

import contextlib
import gc
import os
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from pdjax.jax_setup import enable_compilation_cache  # noqa: E402

enable_compilation_cache()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
CHECKPOINT_DIR = os.path.join(ROOT, "tests", ".checkpoints")


@pytest.fixture(scope="session")
def tiny_checkpoints() -> dict[str, str]:
    """name -> folder of every tiny checkpoint in scripts/make_tiny_checkpoint.py."""
    import make_tiny_checkpoint

    return {name: make_tiny_checkpoint.make_checkpoint(name, CHECKPOINT_DIR)
            for name in make_tiny_checkpoint.CONFIGS}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_processes_unless_slow(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_processes_unless_slow(item):
        yield


_LAUNCHERS = (os.path.join(ROOT, "tests") + os.sep, os.path.join(ROOT, "scripts") + os.sep)


def _launched_by_test_code() -> bool:
    """Whether the process being started was asked for by test or script code (a server, a
    ``python -c`` child), not by the library it calls (the CPU kernels' one-time build runs
    the C++ compiler): the first caller outside the standard library decides."""
    frame = sys._getframe(2)
    stdlib = os.path.dirname(os.__file__) + os.sep
    while frame is not None and frame.f_code.co_filename.startswith(stdlib):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_LAUNCHERS)


@contextlib.contextmanager
def _no_processes_unless_slow(item):
    """The fast tier (``scripts/run_tests.sh --fast``: ``-m 'not slow'``) starts no process: a
    test, or a fixture it sets up, that starts one (``subprocess``, ``asyncio``'s subprocesses,
    a server) without the ``slow`` marker fails here, in every run, saying so."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    real = subprocess.Popen.__init__

    def refuse(self, args, *rest, **kwargs):
        if not _launched_by_test_code():
            return real(self, args, *rest, **kwargs)
        raise AssertionError(f"{item.nodeid} starts a process ({args!r:.120}): mark it "
                             f"@pytest.mark.slow (the fast tier starts none)")

    subprocess.Popen.__init__ = refuse
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real


def _memory_maps() -> tuple[int, int]:
    """(this process's memory maps, the kernel's ``vm.max_map_count``); (0, 0) off Linux."""
    try:
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return maps, int(f.read())
    except OSError:
        return 0, 0


@pytest.fixture(scope="module", autouse=True)
def release_executables():
    """Drop JAX's compiled executables after a test module when the process nears Linux's
    limit on memory maps. XLA CPU maps every kernel of an executable into memory on its own;
    one pytest process keeping all of the suite's executables had 62,169 maps by test 270 of
    1,336, against the default ``vm.max_map_count`` of 65,530, and the next executable the
    compilation cache loaded crashed the process (a segfault in ``deserialize_executable``).
    ``scripts/run_tests.sh`` raises the limit where it may; this is the fallback (a clear
    makes the session's shared engines compile again, so it is not done every module). A
    server compiles a bounded set of buckets and never gets near the limit."""
    yield
    maps, limit = _memory_maps()
    if limit and maps > 0.7 * limit:
        import jax

        jax.clear_caches()
        gc.collect()
