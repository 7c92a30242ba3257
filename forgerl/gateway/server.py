"""uvicorn inside the caller's event loop: the gateway's in-process HTTP server.

Data flow: `Gateway.serve` (app.py) builds the app and starts a `GatewayServer` on a socket bound
here (`listen`), in the running asyncio loop of the controller (or a test); an optional sweep
(`Gateway.expire_idle`) runs beside it. Knows nothing of the gateway's routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the controller owns the process's signals


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket for `host:port` (port 0 = a free port), created with proto
    IPPROTO_TCP.

    asyncio sets TCP_NODELAY on an accepted connection only when its socket's proto is
    IPPROTO_TCP, and an accepted socket inherits the listener's; `socket.create_server` makes
    proto 0. Without TCP_NODELAY, a response written in two sends (uvicorn writes headers and
    body separately) waits for the client's delayed ACK on a keep-alive connection (Nagle +
    delayed ACK). Raises OSError when the address is taken.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class GatewayServer:
    """uvicorn serving an app inside the caller's running asyncio loop.

    The socket is bound here, before serving, so `port` is known (port 0 = a free port) and a
    taken address raises OSError at once; every accepted connection has TCP_NODELAY (`listen`).
    `on_stop` is called once the server has stopped (the request log's close).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 sweep: Callable[[], Any] | None = None, sweep_every_s: float = 1.0,
                 on_stop: Callable[[], Any] | None = None):
        self.sock = listen(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self._sweep, self._sweep_every_s = sweep, sweep_every_s
        self._sweeper: asyncio.Task[None] | None = None
        self._on_stop = on_stop

    async def _sweeping(self) -> None:
        """Call `sweep` (e.g. `Gateway.expire_idle`) every `sweep_every_s` seconds; a failure
        is logged and the sweep goes on."""
        assert self._sweep is not None
        while True:
            await asyncio.sleep(self._sweep_every_s)
            try:
                self._sweep()
            except Exception:
                log.exception("gateway sweep failed")

    @property
    def base_url(self) -> str:
        """`http://host:port/v1`, what an OpenAI client takes as base_url."""
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        """Begin serving; returns once the server accepts connections."""
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # re-raise the startup failure
            await asyncio.sleep(0.01)
        if self._sweep is not None:
            self._sweeper = asyncio.create_task(self._sweeping())

    async def stop(self) -> None:
        """Stop serving, wait for open requests to end, then call `on_stop`; idempotent."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._task is not None:
            self.server.should_exit = True
            await self._task
            self._task = None
            if self._on_stop is not None:
                self._on_stop()
