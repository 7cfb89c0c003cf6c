import pytest

from pdjax.engine import Engine

PAGE = 8
CHUNK_BIG = 64


@pytest.fixture(scope="package")
def llama_engine(tiny_checkpoints):
    """One warmed-up engine on the tiny Llama; tests switch scheduler settings between runs."""
    eng = Engine(tiny_checkpoints["llama"], dtype="float32", page_size=PAGE, max_total_tokens=4096,
                 max_running_requests=16, chunked_prefill_size=CHUNK_BIG, context_length=128,
                 progress=False)
    base = eng.core.sched_config
    yield eng
    eng.core.scheduler.config = base


@pytest.fixture
def overlap(llama_engine):
    """``overlap(on)`` sets ``core.overlap`` for the next run (with a cold prefix cache, so runs
    compare like with like) and returns the engine; the setting is restored afterwards."""
    core = llama_engine.core
    before = core.overlap

    def set_overlap(on: bool):
        assert core._inflight is None
        core.overlap = on
        core.scheduler.prefix_cache.reset()
        return llama_engine

    yield set_overlap
    core.overlap = before
