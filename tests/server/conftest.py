"""Fixtures for the HTTP server tests: a fake engine behind a live aiohttp test server, and
the real ``AsyncEngine`` on the tiny random Llama."""

import os
import sys

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

sys.path.insert(0, os.path.dirname(__file__))

from server_fakes import FakeEngine, build_tokenizer  # noqa: E402

from pdjax.server.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def real_engine(tiny_checkpoints):
    """A started ``AsyncEngine`` on the tiny Llama (CPU, float32), one per test module; every
    module takes these settings, so they share the executables (compilation cache)."""
    from pdjax.config import ServerArgs
    from pdjax.engine import AsyncEngine

    args = ServerArgs(model_path=tiny_checkpoints["llama"], dtype="float32", page_size=8,
                      max_total_tokens=2048, max_running_requests=8, chunked_prefill_size=64,
                      context_length=128, skip_warmup_progress=True)
    engine = AsyncEngine(args, progress=False)
    create_app(engine)          # as serve.py does: the server's metrics exist before start()
    engine.start()
    assert engine.wait_ready(900)
    yield engine
    engine.shutdown()


@pytest.fixture
def tokenizer():
    return build_tokenizer()


@pytest_asyncio.fixture
async def make_client():
    """``await make_client(engine=None, **create_app_kwargs) -> (client, engine)``: a server on
    127.0.0.1 (ephemeral port, handler cancellation on client disconnect)."""
    made = []

    async def make(engine=None, **kwargs):
        engine = engine or FakeEngine()
        client = TestClient(TestServer(create_app(engine, **kwargs)))
        await client.start_server()
        made.append((client, engine))
        return client, engine

    yield make
    for client, engine in made:
        await client.close()
        if isinstance(engine, FakeEngine):      # a real engine belongs to its own fixture
            engine.close()

