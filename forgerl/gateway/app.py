"""The gateway's HTTP edge: the FastAPI app, authentication, errors, the sessions API.

Data flow: agent --HTTP--> route --> protocol module (protocols/chat.py: validate, translate to a
`Conversation`) --> `Gateway.complete` (core.py: render with TITO, dispatch, record, parse) -->
protocol module (wire JSON or SSE) --> agent. Routes are a few lines each; nothing here records.

Endpoints: POST /v1/chat/completions (plain and `stream: true`), POST /v1/messages (Anthropic,
plain and `stream: true`; auth also by `x-api-key`), POST /v1/messages/count_tokens, GET /v1/models,
POST /v1/sessions (open a session for an external agent; while a controller trains, only under a
negative task_index), POST /v1/sessions/{id}/reward (only for sessions that endpoint opened);
both need `Authorization: Bearer <admin_key>` when the gateway has one; POST
/v1/sessions/{id}/events (a process event the session's own agent reports, with its key;
`FORGERL_SESSION_ID` names the session to a controller's agent). Sessions opened there
expire after `session_idle_timeout_s` without a model call (a sweep, `Gateway.expire_idle`).
Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`, Anthropic-shaped on
/v1/messages routes; no traceback body.
A model call whose client disconnects is cancelled down to the engine and records nothing.
Run in-process: `server = await gateway.serve("127.0.0.1", 0)`; `server.base_url`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from forgerl.gateway.core import Gateway
from forgerl.gateway.errors import GatewayError, parse_body
from forgerl.gateway.protocols import anthropic, chat, completions, responses
from forgerl.gateway.sessions import Session
from forgerl.types import UNDELIVERED

__all__ = ["Gateway", "GatewayError", "GatewayServer", "create_app"]

log = logging.getLogger(__name__)
R = TypeVar("R")


# ---- the sessions API ----------------------------------------------------------------------


class SessionRequest(BaseModel):
    """POST /v1/sessions body (an external agent's rollout). Indices are SQLite integers
    (signed 64-bit); `task_index >= 0` is refused while a controller trains (`controller_tasks`)."""

    model_config = ConfigDict(extra="forbid")

    task_index: int = Field(-1, ge=-(2**63), lt=2**63)
    rollout_index: int = Field(0, ge=0, lt=2**63)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)


class RewardRequest(BaseModel):
    """POST /v1/sessions/{id}/reward body: a finite JSON number (any range)."""

    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False, strict=True)


class EventRequest(BaseModel):
    """POST /v1/sessions/{id}/events body: one process event on a turn of the session's
    trajectory (`forgerl.types.Event`; `[reward] process` weights it)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    value: float = Field(1.0, allow_inf_nan=False)
    turn: int | None = Field(None, ge=0, lt=2**31)
    """0-based model call of the session; None = its latest."""


def add_event(gateway: Gateway, session_id: str, session: Session, req: EventRequest) -> int:
    """POST /v1/sessions/{id}/events: record the event; returns its turn.

    Raises GatewayError 403 when the key's session is another one, 400 for the gateway's own
    kind `UNDELIVERED` (it takes a turn out of training), 409 when the trajectory has no such
    turn (or no model call yet) or is no longer running. Nothing is recorded then.
    """
    if session.trajectory_id != session_id:
        raise GatewayError(403, f"this API key belongs to another session than {session_id!r}",
                           "permission_denied", "session_id")
    if req.kind == UNDELIVERED:
        raise GatewayError(400, f"event kind {UNDELIVERED!r} is the gateway's own (a turn whose "
                           "client left before its answer)", "invalid_value", "kind")
    try:
        return gateway.pool.add_event(session_id, req.kind, req.value, req.turn)
    except ValueError as e:
        raise GatewayError(409, str(e), "invalid_turn", "turn") from None


def authenticate(gateway: Gateway, authorization: str | None) -> Session:
    """The session named by an `Authorization: Bearer <api_key>` header; 401 otherwise."""
    scheme, _, key = (authorization or "").partition(" ")
    session = gateway.sessions.get(key.strip()) if scheme.lower() == "bearer" else None
    if session is None:
        msg = "missing API key" if not authorization else "unknown or closed API key"
        raise GatewayError(401, msg, "invalid_api_key")
    return session


def require_admin(gateway: Gateway, authorization: str | None) -> None:
    """Check `Authorization: Bearer <admin_key>` when the gateway has an `admin_key`.

    Raises GatewayError 401 `invalid_api_key` (missing or wrong key); nothing recorded then.
    """
    if gateway.admin_key is None:
        return
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
            key.strip().encode(), gateway.admin_key.encode()):
        msg = "missing admin key" if not authorization else "wrong admin key"
        raise GatewayError(401, f"{msg}: the sessions API needs Authorization: Bearer "
                           "<admin_key>", "invalid_api_key")


def authenticate_key(gateway: Gateway, headers: Mapping[str, str]) -> Session:
    """The session named by `x-api-key: <api_key>` (Anthropic clients) or by
    `Authorization: Bearer <api_key>`, whichever names an open one; 401 otherwise."""
    key = headers.get("x-api-key")
    if key is not None and (session := gateway.sessions.get(key.strip())) is not None:
        return session
    if key is not None and headers.get("authorization") is None:
        raise GatewayError(401, "unknown or closed API key", "invalid_api_key")
    return authenticate(gateway, headers.get("authorization"))


def error_response(request: Request, e: GatewayError) -> JSONResponse:
    """Anthropic-shaped on the Messages routes (/v1/messages...), OpenAI-shaped elsewhere."""
    return e.anthropic_response() if request.url.path.startswith("/v1/messages") else e.response()


def open_external(gateway: Gateway, req: SessionRequest) -> tuple[str, str]:
    """POST /v1/sessions: open a session for an outside agent; (trajectory_id, api_key).

    Raises GatewayError 403 for `task_index >= 0` while `controller_tasks` (the controller
    owns those groups: a foreign rollout would take one of its G places).
    """
    if gateway.controller_tasks and req.task_index >= 0:
        raise GatewayError(
            403,
            f"task_index {req.task_index}: task indices >= 0 are the training groups of the "
            "running controller; a session opened over HTTP takes a negative task_index "
            "(default -1)",
            "permission_denied",
            "task_index",
        )
    trajectory_id, api_key = gateway.open_session(
        req.task_index, req.rollout_index, req.temperature, req.max_tokens
    )
    gateway.external.add(trajectory_id)
    return trajectory_id, api_key


def reward_external(gateway: Gateway, trajectory_id: str, reward: float) -> None:
    """POST /v1/sessions/{id}/reward: finish a session opened over HTTP with `reward`.

    Raises GatewayError 404 (unknown id), 403 (not opened over HTTP: a controller rollout,
    whether its session is open, closed or its trajectory ended), 409 (already ended).
    Nothing in the pool changes when it raises.
    """
    if trajectory_id not in gateway.external:
        try:
            gateway.pool.get_trajectory(trajectory_id)
        except KeyError:
            raise GatewayError(404, f"unknown session {trajectory_id!r}",
                               "session_not_found", "session_id") from None
        raise GatewayError(403, f"session {trajectory_id!r} was not opened by POST "
                           "/v1/sessions; the controller scores its rollout",
                           "permission_denied", "session_id")
    try:
        gateway.finish_session(trajectory_id, reward)
    except ValueError as e:
        raise GatewayError(409, str(e), "trajectory_not_running", "session_id") from None


# ---- the app -------------------------------------------------------------------------------


async def unless_disconnected(
    request: Request, call: Coroutine[Any, Any, R], counters: dict[str, int]
) -> R:
    """Await `call` (a chat completion); cancel it when the client disconnects first.

    The cancellation reaches the engine's `generate`, which frees its batch slot (LocalEngine
    drops a row whose future is cancelled at its next decode step), and nothing is recorded:
    `Gateway.complete` records only after generate returns. Raises GatewayError 499
    `client_disconnected` (no one reads it) and counts `client_disconnects`.
    """
    work = asyncio.ensure_future(call)
    watcher = asyncio.ensure_future(chat.disconnected(request.receive))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (server shutdown)
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work.done():
        return work.result()  # answered (and recorded) before the client left
    work.cancel()
    counters["client_disconnects"] += 1
    with contextlib.suppress(asyncio.CancelledError):
        await work
    raise GatewayError(499, "client disconnected; the request was cancelled",
                       "client_disconnected")


BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": chat.ChatRequest, "/v1/completions": completions.CompletionRequest,
    "/v1/messages": anthropic.MessagesRequest, "/v1/messages/count_tokens":
    anthropic.PromptRequest, "/v1/responses": responses.ResponsesRequest,
    "/v1/sessions": SessionRequest, "/v1/sessions/{session_id}/reward": RewardRequest,
    "/v1/sessions/{session_id}/events": EventRequest}
"""The JSON body model of each POST route, for the OpenAPI document only: handlers parse the
raw body themselves (so errors keep the OpenAI/Anthropic shapes, never FastAPI's 422)."""


def declare_bodies(app: FastAPI) -> None:
    """Declare every POST route's request body (`BODIES`) in `app.openapi()`."""
    refs, defs = models_json_schema([(m, "validation") for m in BODIES.values()],
                                    ref_template="#/components/schemas/{model}")
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = build()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            for path, model in BODIES.items():
                content = {"application/json": {"schema": refs[(model, "validation")]}}
                spec["paths"][path]["post"]["requestBody"] = {"required": True,
                                                              "content": content}
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class InternalErrors:
    """ASGI middleware: an unexpected exception in a handler is logged with its traceback and
    answered as a 500 `internal_error` (OpenAI- or Anthropic-shaped, `error_response`) on a
    connection that stays open. Starlette's handler for Exception re-raises after answering,
    and uvicorn then resets the client's keep-alive connection. An exception after the response
    began (a stream) is re-raised: only the server can end that response."""

    def __init__(self, app: Callable[..., Coroutine[Any, Any, None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        began = False

        async def tracked(message: dict) -> None:
            nonlocal began
            began = began or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if began or scope["type"] != "http":
                raise
            log.exception("unexpected gateway error")
            response = error_response(Request(scope), GatewayError(
                500, f"internal error ({type(e).__name__}); the gateway log has the details",
                "internal_error", type="server_error"))
            await response(scope, receive, send)


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app over `gateway` (thin handlers, OpenAI-shaped errors)."""
    app = FastAPI(title="ForgeRL gateway")
    declare_bodies(app)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError) -> JSONResponse:
        return error_response(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(request, GatewayError(e.status_code, str(e.detail), code))

    app.add_middleware(InternalErrors)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        """OpenAI chat completions (plain or SSE), recorded token-in-token-out."""
        session = authenticate(gateway, request.headers.get("authorization"))
        req, conversation = chat.parse(await request.body())
        if req.stream:
            return chat.respond_stream(req, gateway.stream(session, conversation))
        result = await unless_disconnected(request, gateway.complete(session, conversation),
                                           gateway.counters)
        return chat.respond(req, result)

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Any:
        """OpenAI (legacy) completions of a text or token-id prompt, recorded as given."""
        session = authenticate(gateway, request.headers.get("authorization"))
        body = await request.body()
        with gateway.active(session):  # a prompt surely over max_model_len: C09's event
            call = completions.parse(body, session, gateway.renderer, gateway.engine.max_model_len)
        if call.request.stream:
            return completions.respond_stream(
                call, gateway.stream(session, call.conversation, call.plan), gateway.renderer)
        result = await unless_disconnected(
            request, gateway.complete(session, call.conversation, call.plan), gateway.counters)
        return completions.respond(call, result, gateway.renderer)

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request) -> Any:
        """Anthropic Messages (plain or SSE), recorded token-in-token-out."""
        session = authenticate_key(gateway, request.headers)
        req, conversation = anthropic.parse(await request.body())
        if req.stream:
            return anthropic.respond_stream(req, conversation,
                                            gateway.stream(session, conversation), gateway)
        result = await unless_disconnected(request, gateway.complete(session, conversation),
                                           gateway.counters)
        return anthropic.respond(req, conversation, result, gateway)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request) -> dict[str, int]:
        """Anthropic token counting: the next call's prompt length; nothing recorded."""
        session = authenticate_key(gateway, request.headers)
        return anthropic.count_tokens(gateway, session, await request.body())

    @app.post("/v1/responses")
    async def responses_create(request: Request) -> Any:
        """OpenAI Responses (plain or SSE), recorded token-in-token-out."""
        session = authenticate(gateway, request.headers.get("authorization"))
        req, conversation = responses.parse(await request.body(), session)
        if req.stream:
            return responses.respond_stream(req, session, gateway.stream(session, conversation))
        result = await unless_disconnected(request, gateway.complete(session, conversation),
                                           gateway.counters)
        return responses.respond(req, session, result)

    card = {"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "forgerl"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The one served model."""
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        """The served model's card (`client.models.retrieve`); 404 `model_not_found` else."""
        if model_id != gateway.model_name:
            raise GatewayError(404, f"model {model_id!r} does not exist; serving "
                               f"{gateway.model_name!r}", "model_not_found", "model")
        return card

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> dict[str, str]:
        """Open a session for an external agent: {session_id, api_key}."""
        require_admin(gateway, request.headers.get("authorization"))
        body = parse_body(await request.body(), SessionRequest)
        trajectory_id, api_key = open_external(gateway, body)
        return {"session_id": trajectory_id, "api_key": api_key}

    @app.post("/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> dict[str, Any]:
        """Finish an externally opened session's trajectory with its reward."""
        require_admin(gateway, request.headers.get("authorization"))
        body = parse_body(await request.body(), RewardRequest)
        reward_external(gateway, session_id, body.reward)
        return {"session_id": session_id, "status": "finished", "reward": body.reward}

    @app.post("/v1/sessions/{session_id}/events")
    async def event(session_id: str, request: Request) -> dict[str, Any]:
        """Record a process event that the session's own agent reports (Bearer: its key)."""
        session = authenticate(gateway, request.headers.get("authorization"))
        body = parse_body(await request.body(), EventRequest)
        turn = add_event(gateway, session_id, session, body)
        return {"session_id": session_id, "turn": turn, "kind": body.kind, "value": body.value}

    return app


# ---- in-process server ---------------------------------------------------------------------


class _Server(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the controller owns the process's signals


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket for `host:port` (port 0 = a free port), created with proto
    IPPROTO_TCP.

    asyncio sets TCP_NODELAY on an accepted connection only when its socket's proto is
    IPPROTO_TCP, and an accepted socket inherits the listener's; `socket.create_server` makes
    proto 0. Without TCP_NODELAY, a response written in two sends (uvicorn writes headers and
    body separately) waits for the client's delayed ACK: about 40 ms per call on a keep-alive
    connection (Nagle + delayed ACK). Raises OSError when the address is taken.
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
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 sweep: Callable[[], Any] | None = None, sweep_every_s: float = 1.0):
        self.sock = listen(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self._sweep, self._sweep_every_s = sweep, sweep_every_s
        self._sweeper: asyncio.Task[None] | None = None

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
        """Stop serving and wait for open requests to end; idempotent."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._task is not None:
            self.server.should_exit = True
            await self._task
            self._task = None
