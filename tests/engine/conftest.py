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
