"""The gateway's HTTP edge: an OpenAI-compatible FastAPI app that records every LLM call.

Data flow: agent --HTTP--> `create_app` handlers --> `Gateway.complete` (render with TITO,
clamp, dispatch token ids to the rollout engine, parse tool calls, record a `Completion` in the
data pool) --> OpenAI-shaped JSON or SSE back to the agent. Handlers are thin; rendering lives in
renderer.py, turn trees in sessions.py, parsing in tool_parsers.py.

Endpoints: POST /v1/chat/completions (plain and `stream: true`), GET /v1/models,
POST /v1/sessions (open a session for an external agent; while a controller trains, only under a
negative task_index), POST /v1/sessions/{id}/reward (only for sessions that endpoint opened).
Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`; no traceback body.
A chat call whose client disconnects is cancelled down to the engine and records nothing.
Run in-process: `server = await gateway.serve("127.0.0.1", 0)`; `server.base_url`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from forgerl.datapool.base import DataPool
from forgerl.engines.base import RolloutEngine
from forgerl.gateway.renderer import ChatMLRenderer
from forgerl.gateway.sessions import Session, SessionStore, Turn
from forgerl.gateway.tool_parsers import ParsedReply, parse_tool_calls
from forgerl.types import Completion, SamplingParams

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """An error answered to the client as OpenAI JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = (
            status,
            message,
            code,
            param,
            type,
        )

    def response(self) -> JSONResponse:
        """The OpenAI-shaped JSON error body with this error's HTTP status."""
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


# ---- request schemas (the HTTP edge: extra fields allowed and ignored) ----------------------


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Loose):
    """One part of a list-valued `content`; only `text` parts are rendered."""

    type: str
    text: str | None = None


class FunctionCall(_Loose):
    """A tool call's function: name and arguments (a JSON string or an object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Loose):
    """An assistant message's tool call (OpenAI shape)."""

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Loose):
    """One chat message; `tool_calls` on assistant turns, `tool_call_id` on tool turns."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDecl(_Loose):
    """A declared tool: name, description, JSON-schema parameters."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDecl(_Loose):
    """`{"type": "function", "function": {...}}` in the request's `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDecl


class StreamOptions(_Loose):
    """`stream_options`: `include_usage` adds a final usage chunk."""

    include_usage: bool = False


class ChatRequest(_Loose):
    """POST /v1/chat/completions body. The session's temperature / max_tokens override
    the request's; `max_completion_tokens` wins over `max_tokens`; max tokens are clamped to
    the context left after the prompt."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDecl] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int = Field(1, ge=1, le=1)
    """One choice per call: an agent that wants G samples runs G sessions (one trajectory each)."""
    stream: bool = False
    stream_options: StreamOptions | None = None


class SessionRequest(_Loose):
    """POST /v1/sessions body (an external agent's rollout). Indices are SQLite integers
    (signed 64-bit); `task_index >= 0` is refused while a controller trains (`controller_tasks`)."""

    task_index: int = Field(-1, ge=-(2**63), lt=2**63)
    rollout_index: int = Field(0, ge=0, lt=2**63)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)


class RewardRequest(_Loose):
    """POST /v1/sessions/{id}/reward body: a finite JSON number (any range)."""

    reward: float = Field(allow_inf_nan=False, strict=True)


M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")


def parse_body(raw: bytes, schema: type[M]) -> M:
    """Validate a JSON body; malformed JSON and wrong types are both 400 (as OpenAI answers)."""
    try:
        return schema.model_validate_json(raw or b"{}")
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        kind = "invalid_json" if err.get("type") == "json_invalid" else "invalid_type"
        raise GatewayError(400, f"{param or 'body'}: {err.get('msg')}", kind, param) from None


# ---- the gateway ---------------------------------------------------------------------------


@dataclass
class Gateway:
    """Renderer + sessions + engine + pool: everything one chat call needs.

    temperature / max_tokens: defaults when neither the session nor the request sets them.
    strict_model: refuse (404) model names other than `model_name`.
    counters: requests, completion_tokens, prefix_hits, prefix_misses, tool_parse_errors,
    engine_errors, client_disconnects (calls cancelled because their client went away).
    """

    renderer: ChatMLRenderer
    engine: RolloutEngine
    pool: DataPool
    model_name: str
    sessions: SessionStore = field(default_factory=SessionStore)
    temperature: float = 1.0
    max_tokens: int = 256
    strict_model: bool = True
    external: set[str] = field(default_factory=set)
    """Trajectory ids opened over HTTP (POST /v1/sessions): only these take rewards over HTTP,
    whatever their state; the controller scores its own rollouts."""
    controller_tasks: bool = False
    """True while a controller trains on this pool (`forgerl train`): every task index >= 0 is
    one of its training groups, so POST /v1/sessions refuses `task_index >= 0` (403) and outside
    sessions take negative (ad-hoc) indices. False (`forgerl gateway`): any index is accepted."""
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("requests", "completion_tokens", "prefix_hits", "prefix_misses", "tool_parse_errors",
             "engine_errors", "client_disconnects"), 0
        )
    )

    def open_session(
        self,
        task_index: int = -1,
        rollout_index: int = 0,
        temperature: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> tuple[str, str]:
        """Create a running trajectory and a session for it; returns (trajectory_id, api_key).

        `seed`: the session's sampling seed (see `Session.seed`); None = unseeded.
        """
        trajectory_id = self.pool.create_trajectory(
            task_index=task_index, rollout_index=rollout_index
        )
        return trajectory_id, self.sessions.create(trajectory_id, temperature, max_tokens,
                                                   seed=seed)

    def finish_session(self, trajectory_id: str, reward: float | None) -> None:
        """Mark the trajectory finished with `reward` and close its session.

        Raises KeyError (unknown trajectory) or ValueError (already ended) from the pool.
        """
        self.pool.finish_trajectory(trajectory_id, "finished", reward=reward)
        session = self.sessions.find(trajectory_id)
        if session is not None:
            self.sessions.close(session.api_key)

    def open_external(self, req: SessionRequest) -> tuple[str, str]:
        """POST /v1/sessions: open a session for an outside agent; (trajectory_id, api_key).

        Raises GatewayError 403 for `task_index >= 0` while `controller_tasks` (the controller
        owns those groups: a foreign rollout would take one of its G places).
        """
        if self.controller_tasks and req.task_index >= 0:
            raise GatewayError(
                403,
                f"task_index {req.task_index}: task indices >= 0 are the training groups of the "
                "running controller; a session opened over HTTP takes a negative task_index "
                "(default -1)",
                "permission_denied",
                "task_index",
            )
        trajectory_id, api_key = self.open_session(
            req.task_index, req.rollout_index, req.temperature, req.max_tokens
        )
        self.external.add(trajectory_id)
        return trajectory_id, api_key

    def reward_external(self, trajectory_id: str, reward: float) -> None:
        """POST /v1/sessions/{id}/reward: finish a session opened over HTTP with `reward`.

        Raises GatewayError 404 (unknown id), 403 (not opened over HTTP: a controller rollout,
        whether its session is open, closed or its trajectory ended), 409 (already ended).
        Nothing in the pool changes when it raises.
        """
        if trajectory_id not in self.external:
            try:
                self.pool.get_trajectory(trajectory_id)
            except KeyError:
                raise GatewayError(404, f"unknown session {trajectory_id!r}",
                                   "session_not_found", "session_id") from None
            raise GatewayError(403, f"session {trajectory_id!r} was not opened by POST "
                               "/v1/sessions; the controller scores its rollout",
                               "permission_denied", "session_id")
        try:
            self.finish_session(trajectory_id, reward)
        except ValueError as e:
            raise GatewayError(409, str(e), "trajectory_not_running", "session_id") from None

    def authenticate(self, authorization: str | None) -> Session:
        """The session named by an `Authorization: Bearer <api_key>` header; 401 otherwise."""
        scheme, _, key = (authorization or "").partition(" ")
        session = self.sessions.get(key.strip()) if scheme.lower() == "bearer" else None
        if session is None:
            msg = "missing API key" if not authorization else "unknown or closed API key"
            raise GatewayError(401, msg, "invalid_api_key")
        return session

    def check_model(self, model: str) -> None:
        """Raises GatewayError 404 `model_not_found` for a model other than `model_name` (when
        `strict_model`)."""
        if self.strict_model and model != self.model_name:
            raise GatewayError(
                404,
                f"model {model!r} does not exist; serving {self.model_name!r}",
                "model_not_found",
                "model",
            )

    def sampling_params(
        self, session: Session, req: ChatRequest, prompt_len: int
    ) -> SamplingParams:
        """Session overrides > request > gateway defaults; max_tokens clamped to the context.

        Raises GatewayError 400 for top_p < 1 on a training session (CASES.md C04: recorded
        logprobs are full-support) and for prompts of max_model_len tokens or more (C09).
        """
        top_p = 1.0 if req.top_p is None else req.top_p
        if top_p < 1.0 and session.training:
            raise GatewayError(
                400,
                f"top_p ({top_p}) < 1 is refused for training rollouts: the "
                "recorded logprobs are over the full vocabulary",
                "unsupported_value",
                "top_p",
            )
        room = self.engine.max_model_len - prompt_len
        if room <= 0:
            raise GatewayError(
                400,
                f"prompt has {prompt_len} tokens; max_model_len is {self.engine.max_model_len}",
                "context_length_exceeded",
                "messages",
            )
        temperature = next(
            t for t in (session.temperature, req.temperature, self.temperature) if t is not None
        )
        wanted = next(
            m
            for m in (
                session.max_tokens,
                req.max_completion_tokens,
                req.max_tokens,
                self.max_tokens,
            )
            if m is not None
        )
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=min(wanted, room),
            stop_token_ids=(self.renderer.end_of_turn_id,),
            seed=req.seed if req.seed is not None or session.seed is None
            else (session.seed + len(session.turns)) % 2**63,
        )

    async def complete(self, session: Session, req: ChatRequest) -> tuple[Completion, ParsedReply]:
        """Render (TITO), dispatch, parse, record one chat call; returns the record and the parse.

        Nothing is recorded when this raises; earlier records are untouched.
        """
        self.check_model(req.model)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        plan = session.plan(messages, tools, self.renderer)
        params = self.sampling_params(session, req, len(plan.prompt_ids))
        self.counters["requests"] += 1
        started_at = time.time()
        weight_version = self.engine.weight_version  # stamped right before dispatch
        try:
            out = await self.engine.generate(plan.prompt_ids, params)
        except Exception as e:
            self.counters["engine_errors"] += 1
            log.exception("engine failed on trajectory %s", session.trajectory_id)
            raise GatewayError(
                500, f"engine error: {type(e).__name__}: {e}", "engine_error", type="server_error"
            ) from e
        ended_at = time.time()
        ids = out.completion_ids
        text = self.renderer.decode(
            ids[:-1] if ids and ids[-1] == self.renderer.end_of_turn_id else ids
        )
        declared = {t["function"]["name"] for t in tools} if tools else None
        parsed = parse_tool_calls(text, declared) if tools else ParsedReply(content=text)
        if out.finish_reason != "length":  # a truncated call is not a parse error (C09)
            self.counters["tool_parse_errors"] += len(parsed.errors)
        finish = (
            "tool_calls" if parsed.tool_calls and out.finish_reason == "stop" else out.finish_reason
        )
        completion = Completion(
            prompt_ids=plan.prompt_ids,
            completion_ids=list(ids),
            logprobs=list(out.logprobs),
            weight_versions=list(out.weight_versions),
            weight_version=weight_version,
            finish_reason=finish,
            sampling=params,
            started_at=started_at,
            ended_at=ended_at,
            extends_previous=plan.extends_previous,
        )
        try:
            self.pool.add_completion(session.trajectory_id, completion)
            self.counters["completion_tokens"] += len(completion.completion_ids)
        except (KeyError, ValueError) as e:
            raise GatewayError(
                409,
                f"trajectory {session.trajectory_id} takes no completions: {e}",
                "trajectory_not_running",
            ) from e
        if plan.extends_previous:
            self.counters["prefix_hits"] += 1
        elif session.turns:
            self.counters["prefix_misses"] += 1
        assistant = _message(parsed)
        session.record(
            Turn(messages, tools, plan.prompt_ids, list(ids), assistant, plan.parent),
            plan.extends_previous,
        )
        return completion, parsed

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> GatewayServer:
        """Start the HTTP app inside the running event loop; port 0 picks a free port."""
        server = GatewayServer(create_app(self), host, port)
        await server.start()
        return server


# ---- responses -----------------------------------------------------------------------------


def _message(parsed: ParsedReply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    return msg


def _usage(c: Completion) -> dict[str, int]:
    p, n = len(c.prompt_ids), len(c.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def chat_response(cid: str, model: str, c: Completion, parsed: ParsedReply) -> dict[str, Any]:
    """An OpenAI `chat.completion` object."""
    choice = {
        "index": 0,
        "message": _message(parsed),
        "finish_reason": c.finish_reason,
        "logprobs": None,
    }
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(c.started_at),
        "model": model,
        "choices": [choice],
        "usage": _usage(c),
    }


def chat_chunks(
    cid: str, model: str, c: Completion, parsed: ParsedReply, include_usage: bool
) -> Iterator[str]:
    """SSE lines of a `chat.completion.chunk` stream: role, content, tool calls, finish, usage."""

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
        choices = (
            []
            if delta is None
            else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        )
        obj = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": int(c.started_at),
            "model": model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if parsed.content:
        yield chunk({"content": parsed.content})
    for i, call in enumerate(parsed.tool_calls):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, c.finish_reason)
    if include_usage:
        yield chunk(None, usage=_usage(c))
    yield "data: [DONE]\n\n"


# ---- the app -------------------------------------------------------------------------------


async def _disconnected(request: Request) -> None:
    """Return once the HTTP client has gone (the ASGI server reports `http.disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
    watcher = asyncio.ensure_future(_disconnected(request))
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


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app over `gateway` (thin handlers, OpenAI-shaped errors)."""
    app = FastAPI(title="ForgeRL gateway")

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, e: GatewayError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return GatewayError(e.status_code, str(e.detail), code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected gateway error")
        return GatewayError(
            500, f"internal error: {type(e).__name__}: {e}", "internal_error", type="server_error"
        ).response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        """OpenAI chat completions (plain or SSE), recorded token-in-token-out."""
        session = gateway.authenticate(request.headers.get("authorization"))
        req = parse_body(await request.body(), ChatRequest)
        completion, parsed = await unless_disconnected(request, gateway.complete(session, req),
                                                       gateway.counters)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if not req.stream:
            return chat_response(cid, req.model, completion, parsed)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            chat_chunks(cid, req.model, completion, parsed, usage), media_type="text/event-stream"
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The one served model."""
        card = {"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "forgerl"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> dict[str, str]:
        """Open a session for an external agent: {session_id, api_key}."""
        body = parse_body(await request.body(), SessionRequest)
        trajectory_id, api_key = gateway.open_external(body)
        return {"session_id": trajectory_id, "api_key": api_key}

    @app.post("/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> dict[str, Any]:
        """Finish an externally opened session's trajectory with its reward."""
        body = parse_body(await request.body(), RewardRequest)
        gateway.reward_external(session_id, body.reward)
        return {"session_id": session_id, "status": "finished", "reward": body.reward}

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

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.sock = listen(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None

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

    async def stop(self) -> None:
        """Stop serving and wait for open requests to end; idempotent."""
        if self._task is not None:
            self.server.should_exit = True
            await self._task
            self._task = None
