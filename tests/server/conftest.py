"""Fixtures for the HTTP server tests: a fake engine behind a live aiohttp test server."""

import os
import sys

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

sys.path.insert(0, os.path.dirname(__file__))

from server_fakes import FakeEngine, build_tokenizer  # noqa: E402

from pdjax.server.app import create_app  # noqa: E402


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

