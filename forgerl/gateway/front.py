"""The front of N gateway processes: one address, each session kept on the gateway that opened it.

Data flow: agent --HTTP/1.1 keep-alive--> `Front` (asyncio, h11) --one keep-alive connection per
(client connection, worker)--> worker gateway (app.py under uvicorn, its own engine) --> the
shared data pool. The front reads each request whole (head and body), picks its worker, relays
the answer as it arrives (SSE included) and adds `x-forgerl-gateway: <worker index>`:

- POST /v1/sessions goes to the live worker with the fewest open sessions (ties: round robin);
  the front reads its JSON answer and remembers the session's key and id → that worker.
- a request whose key (`Authorization: Bearer` / `x-api-key`) or path (/v1/sessions/{id}/...)
  names a remembered session goes to the session's worker; any other request goes to the next
  live worker (which answers 401 for a key it does not know).
- a worker that refuses connections or closes one before answering is dead (`mark_dead`, also
  called by the supervisor when the process exits): requests for its sessions get 503 in the
  client's API shape (Anthropic JSON on /v1/messages, OpenAI JSON elsewhere) naming it, with
  `x-should-retry: false`; `on_dead` gets its sessions' trajectory ids (the supervisor marks
  them failed in the pool). A worker that dies after its answer began: the client connection is
  closed. A reused upstream connection that fails before answering is retried once on a new one
  (the worker may have closed it idle).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import Callable
from typing import Any

import h11

from forgerl.gateway.errors import GatewayError
from forgerl.gateway.server import listen

log = logging.getLogger(__name__)

_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade",
        b"expect"}


class WorkerDown(Exception):
    """The worker closed or refused the connection before its answer began."""


class _Upstream:
    """One keep-alive HTTP/1.1 connection to a worker."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer, self.conn = reader, writer, h11.Connection(h11.CLIENT)

    async def event(self) -> Any:
        return await _event(self.conn, self.reader)

    def close(self) -> None:
        self.writer.close()


async def _event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while (ev := conn.next_event()) is h11.NEED_DATA:
        conn.receive_data(await reader.read(65536))
    return ev


class Front:
    """An asyncio HTTP/1.1 front for gateway workers at `addresses` ((host, port) each).

    `on_dead(index, trajectory_ids, reason)` is called once per worker found dead.
    `loopback_sessions`: the workers open sessions for loopback clients without a key (a
    generated admin key); since every request reaches them from this front's loopback address,
    the front refuses POST /v1/sessions without a key from any other client itself (401).
    """

    def __init__(self, addresses: list[tuple[str, int]],
                 on_dead: Callable[[int, list[str], str], Any] | None = None,
                 loopback_sessions: bool = False):
        self.addresses, self.on_dead, self.loopback_sessions = addresses, on_dead, loopback_sessions
        self.dead: dict[int, str] = {}
        self.keys: dict[str, int] = {}
        self.trajectories: dict[str, int] = {}
        self._key_of: dict[str, str] = {}  # open session id -> its API key
        self.open_sessions = [0] * len(addresses)
        self._next = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on host:port (0 = a free port); returns the port. OSError when taken. The
        listen backlog is uvicorn's (the workers'), not asyncio's 100: a burst of new agents
        (CASES.md C20) is not left waiting for a SYN resend while the front is busy."""
        self._server = await asyncio.start_server(self._client, sock=listen(host, port),
                                                  backlog=2048)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def mark_dead(self, index: int, reason: str) -> None:
        """Take worker `index` out of service (idempotent); its sessions then get 503."""
        if index in self.dead:
            return
        self.dead[index] = reason
        ids = [t for t, w in self.trajectories.items() if w == index]
        log.error("gateway worker %d is down (%s): %d open sessions failed", index, reason,
                  len(ids))
        if self.on_dead is not None:
            self.on_dead(index, ids, reason)

    def route(self, method: bytes, path: str, headers: list[tuple[bytes, bytes]]) -> int | None:
        """The worker index for a request; None when no worker is alive."""
        if path.startswith("/v1/sessions/"):
            if (w := self.trajectories.get(path.split("/")[3])) is not None:
                return w
        else:
            for name, value in headers:
                if name in (b"authorization", b"x-api-key"):
                    key = value.decode("latin-1").removeprefix("Bearer ").strip()
                    if (w := self.keys.get(key)) is not None:
                        return w
        live = [i for i in range(len(self.addresses)) if i not in self.dead]
        if not live:
            return None
        n, start = len(self.addresses), self._next
        self._next = (self._next + 1) % n
        if method == b"POST" and path == "/v1/sessions":
            return min(live, key=lambda i: (self.open_sessions[i], (i - start) % n))
        return min(live, key=lambda i: (i - start) % n)

    def _learn(self, index: int, method: bytes, path: str, status: int, body: bytes) -> None:
        """Remember a session opened (POST /v1/sessions), or forget one rewarded and its key."""
        if status != 200 or method != b"POST":
            return
        if path == "/v1/sessions":
            answer = json.loads(body)
            self.keys[answer["api_key"]] = self.trajectories[answer["session_id"]] = index
            self._key_of[answer["session_id"]] = answer["api_key"]
            self.open_sessions[index] += 1
        elif (path.startswith("/v1/sessions/") and path.endswith("/reward")
              and self.trajectories.pop(sid := path.split("/")[3], None) is not None):
            self.keys.pop(self._key_of.pop(sid), None)
            self.open_sessions[index] -= 1

    def _refusal(self, path: str, index: int | None, peer: str | None,
                 headers: list[tuple[bytes, bytes]]) -> GatewayError | None:
        """The front's own answer to a request, if any (a dead worker, no key from afar)."""
        if index is None or index in self.dead:
            why = "no gateway worker is alive" if index is None else (
                f"gateway worker {index} is down ({self.dead[index]}); this session's trajectory "
                "is marked failed: open a new session")
            return GatewayError(503, why, "gateway_unavailable", type="api_error")
        if (self.loopback_sessions and path == "/v1/sessions" and not _loopback(peer)
                and not any(n in (b"authorization", b"x-api-key") for n, _ in headers)):
            return GatewayError(401, "missing admin key: the sessions API needs Authorization: "
                                "Bearer <admin_key>", "invalid_api_key")
        return None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        peer = (writer.get_extra_info("peername") or (None,))[0]
        upstreams: dict[int, _Upstream] = {}
        try:
            while True:
                req = await _event(conn, reader)
                if not isinstance(req, h11.Request):
                    return
                if conn.they_are_waiting_for_100_continue:  # curl's large bodies
                    writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                body = bytearray()
                while not isinstance(ev := await _event(conn, reader), h11.EndOfMessage):
                    if isinstance(ev, h11.ConnectionClosed):
                        return
                    body += ev.data
                if not await self._answer(conn, writer, upstreams, req, bytes(body), peer):
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (h11.ProtocolError, ConnectionError, OSError):
            return
        finally:
            for up in upstreams.values():
                up.close()
            writer.close()

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                      upstreams: dict[int, _Upstream], req: h11.Request, body: bytes,
                      peer: str | None) -> bool:
        """Answer one request; False when the client connection must close."""
        path = req.target.decode("latin-1").split("?", 1)[0]
        index = self.route(req.method, path, req.headers)
        if (refused := self._refusal(path, index, peer, req.headers)) is not None:
            return await self._send_error(conn, writer, refused, path)
        assert index is not None
        headers = [(n, v) for n, v in req.headers if n.lower() not in _HOP]
        headers.append((b"content-length", str(len(body)).encode()))
        try:
            up, head = await self._forward(index, upstreams, req, headers, body)
        except WorkerDown as e:
            self.mark_dead(index, str(e))
            return await self._send_error(conn, writer, self._refusal(path, index, peer, []), path)
        out = [(n, v) for n, v in head.headers if n not in _HOP or n == b"content-length"]
        out.append((b"x-forgerl-gateway", str(index).encode()))
        chunks = [conn.send(h11.Response(status_code=head.status_code, headers=out,
                                         reason=head.reason))]
        stream = not any(n == b"content-length" for n, _ in head.headers)  # SSE: chunked
        learn = bytearray() if path.startswith("/v1/sessions") else None
        while not isinstance(ev := await up.event(), h11.EndOfMessage):
            if isinstance(ev, h11.ConnectionClosed):  # died mid-answer
                upstreams.pop(index).close()
                return False
            if learn is not None:
                learn += ev.data
            chunks.append(conn.send(h11.Data(data=ev.data)))
            if stream:  # each event as it comes; a sized answer in one write
                writer.write(b"".join(chunks))
                chunks.clear()
                await writer.drain()
        if learn is not None:  # before the client has the answer: its next call finds the key
            self._learn(index, req.method, path, head.status_code, bytes(learn))
        chunks.append(conn.send(h11.EndOfMessage()))
        writer.write(b"".join(chunks))
        await writer.drain()
        if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
            up.conn.start_next_cycle()
        else:
            upstreams.pop(index).close()
        return True

    async def _forward(self, index: int, upstreams: dict[int, _Upstream], req: h11.Request,
                       headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[_Upstream, Any]:
        """Send the request to worker `index`; (its connection, the answer's head). Raises
        WorkerDown when a new connection is refused or closed before the answer's head."""
        for _ in range(2):
            up = upstreams.pop(index, None)
            reused = up is not None
            if up is None:
                try:
                    up = _Upstream(*await asyncio.open_connection(*self.addresses[index]))
                except OSError as e:
                    raise WorkerDown(f"connection refused: {e.strerror or e}") from None
            try:
                up.writer.write(up.conn.send(h11.Request(
                    method=req.method, target=req.target, headers=headers)) + up.conn.send(
                    h11.Data(data=body)) + up.conn.send(h11.EndOfMessage()))
                await up.writer.drain()
                while isinstance(head := await up.event(), h11.InformationalResponse):
                    pass
                if not isinstance(head, h11.Response):
                    raise ConnectionResetError
            except (ConnectionError, OSError, h11.ProtocolError):
                up.close()
                if reused:
                    continue  # an idle keep-alive connection the worker closed: once more
                raise WorkerDown("closed the connection without an answer") from None
            upstreams[index] = up
            return up, head
        raise WorkerDown("closed the connection without an answer")

    @staticmethod
    async def _send_error(conn: h11.Connection, writer: asyncio.StreamWriter, e: GatewayError,
                          path: str) -> bool:
        """The front's own error answer, in the client's API shape."""
        resp = e.response_for(path)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(resp.body)).encode()),
                   (b"x-should-retry", b"false")]
        writer.write(conn.send(h11.Response(status_code=e.status, headers=headers)))
        writer.write(conn.send(h11.Data(data=bytes(resp.body))) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        return True


def _loopback(host: str | None) -> bool:
    with contextlib.suppress(ValueError, TypeError):
        return ipaddress.ip_address(host or "").is_loopback
    return False
