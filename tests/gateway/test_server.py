"""The in-process HTTP server: every accepted connection sends without Nagle's delay.

Replays issue 10's report: on a keep-alive connection each response waited about 40 ms (the
listening socket came from `socket.create_server`, proto 0, so asyncio never set TCP_NODELAY on
accepted connections, and uvicorn's two writes per response met the client's delayed ACK).
Pins: the server side of a keep-alive connection has TCP_NODELAY set; a taken address fails
with OSError when the server is built, not later inside uvicorn. Timings live in
benchmarks/gateway.py.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI

from forgerl.gateway.app import GatewayServer
from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import ScriptedEngine, reply


def test_keep_alive_connections_have_tcp_nodelay(serve, tokenizer):
    srv = serve(ScriptedEngine([reply(ChatMLRenderer(tokenizer), "hi")]), tokenizer)
    _, key = srv.session()
    with httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {key}"}) as c:
        assert c.get("/models").status_code == 200
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        assert c.post("/chat/completions", json=body).status_code == 200

        async def server_side() -> list[int]:
            connections = srv.server.server.server_state.connections
            sockets = [p.transport.get_extra_info("socket") for p in connections]
            return [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets]

        flags = asyncio.run_coroutine_threadsafe(server_side(), srv.loop).result(10)
    assert len(flags) == 1 and flags[0] != 0  # one keep-alive connection, Nagle off


def test_taken_address_fails_when_built():
    first = GatewayServer(FastAPI(), "127.0.0.1", 0)
    first.sock.listen()
    try:
        with pytest.raises(OSError):
            GatewayServer(FastAPI(), "127.0.0.1", first.port)
    finally:
        first.sock.close()
