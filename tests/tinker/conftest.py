"""A real ForgeRL Tinker server (uvicorn on 127.0.0.1 in a thread) over the tiny model, and the
unmodified `tinker` SDK pointed at it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tinker", reason="the optional extra forgerl[tinker] is not installed")

from forgerl.engines.local import LocalEngine
from forgerl.gateway.server import GatewayServer
from forgerl.models import build_byte_tokenizer, build_tiny_model
from forgerl.tinker.app import build_app
from forgerl.tinker.sampling import EngineSampler
from forgerl.tinker.service import TinkerService

TINY = "forgerl/tiny"


def tiny_service(root: Path, engine: bool = False) -> tuple[TinkerService, EngineSampler | None]:
    """The tiny Llama (own LM head, so distributions are not flat) under the name TINY; with
    `engine`, a LocalEngine on its own copy samples."""
    model = build_tiny_model(head_std=0.2)
    local = LocalEngine(model, 256, 8) if engine else None  # before the service's hooks
    service = TinkerService(model, TINY, root, eos_ids=[2], max_model_len=256, lora_alpha=16.0)
    return service, EngineSampler(service, local) if local else None


class ServerThread:
    """`build_app(service)` served by uvicorn in a thread with its own event loop."""

    def __init__(self, service: TinkerService, tokenizer: object = None,
                 engine: EngineSampler | None = None) -> None:
        self.service, self.engine = service, engine
        self.app = build_app(service, tokenizer, engine)
        self.loop = asyncio.new_event_loop()
        self.server = GatewayServer(self.app)
        self.url = f"http://127.0.0.1:{self.server.port}"
        started = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            started.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert started.wait(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.app.state.jobs.close()
        if self.engine is not None:
            asyncio.run_coroutine_threadsafe(self.engine.engine.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(params=["worker", "engine"])
def server(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[ServerThread]:
    """Sampling on the worker thread, or through the local engine (per-row adapters)."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-any-key")  # the SDK needs one; any is accepted
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service, engine = tiny_service(tmp_path / "tinker", request.param == "engine")
    srv = ServerThread(service, build_byte_tokenizer(), engine)
    yield srv
    srv.close()
