"""A real ForgeRL Tinker server (uvicorn on 127.0.0.1 in a thread) over the tiny model, and the
unmodified `tinker` SDK pointed at it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tinker", reason="the optional extra forgerl[tinker] is not installed")

from forgerl.gateway.server import GatewayServer
from forgerl.models import build_byte_tokenizer, build_tiny_model
from forgerl.tinker.app import build_app
from forgerl.tinker.service import TinkerService

TINY = "forgerl/tiny"


def tiny_service(root: Path) -> TinkerService:
    """The tiny Llama (own LM head, so distributions are not flat) under the name TINY."""
    return TinkerService(build_tiny_model(head_std=0.2), TINY, root, eos_ids=[2],
                         max_model_len=256, lora_alpha=16.0)


class ServerThread:
    """`build_app(service)` served by uvicorn in a thread with its own event loop."""

    def __init__(self, service: TinkerService, tokenizer: object = None) -> None:
        self.service = service
        self.app = build_app(service, tokenizer)
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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerThread]:
    monkeypatch.setenv("TINKER_API_KEY", "tml-any-key")  # the SDK needs one; any is accepted
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    srv = ServerThread(tiny_service(tmp_path / "tinker"), build_byte_tokenizer())
    yield srv
    srv.close()
