"""``EngineClient`` (``pdjax.server.engine_client``): what the server calls on the engine. The
production client and the test fake both satisfy it; anything else is refused at ``create_app``."""

import pytest
from server_fakes import FakeEngine

from pdjax.config import ServerArgs
from pdjax.engine import AsyncEngine
from pdjax.server.app import create_app
from pdjax.server.engine_client import (ArgsOwner, CoreOwner, EngineClient, PDRejecter,
                                        StartupReporter)

REQUIRED = ("tokenizer", "model_path", "served_model_name", "is_ready", "unhealthy_reason",
            "metrics", "context_length", "generate", "abort", "flush_cache", "get_load", "server_info",
            "start_profile", "stop_profile")


def test_async_engine_is_an_engine_client_with_every_capability(tiny_checkpoints):
    engine = AsyncEngine(ServerArgs(model_path=tiny_checkpoints["llama"]), progress=False)
    assert isinstance(engine, EngineClient)
    for capability in (StartupReporter, PDRejecter, ArgsOwner, CoreOwner):
        assert isinstance(engine, capability), capability.__name__
    assert engine.core is None and engine.context_length == 0     # not started


def test_the_fake_engine_is_an_engine_client_without_the_optional_capabilities():
    engine = FakeEngine()
    try:
        assert isinstance(engine, EngineClient)
        for capability in (StartupReporter, PDRejecter, ArgsOwner, CoreOwner):
            assert not isinstance(engine, capability), capability.__name__
    finally:
        engine.close()


def test_the_protocol_lists_what_the_server_calls():
    members = set(EngineClient.__annotations__) | {
        m for m in vars(EngineClient) if not m.startswith("_")}
    assert members == set(REQUIRED)


@pytest.mark.parametrize("missing", ["abort", "get_load", "context_length"])
def test_create_app_refuses_an_object_that_is_not_an_engine_client(missing):
    class Partial:
        pass

    partial = Partial()
    for name in REQUIRED:
        if name != missing:
            setattr(partial, name, None)
    assert not isinstance(partial, EngineClient)
    with pytest.raises(TypeError, match="engine_client: Partial is not an EngineClient"):
        create_app(partial)
