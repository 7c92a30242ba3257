"""The gateway's HTTP edge: the FastAPI app and its thin routes, and the servable `Gateway`.

Data flow: agent --HTTP--> route --> protocol module (protocols/chat.py: validate, translate to a
`Conversation`) --> `Gateway.complete` (core.py: render with TITO, dispatch, record, parse) -->
protocol module (wire JSON or SSE) --> agent. Routes are a few lines each; nothing here records.

Endpoints: POST /v1/chat/completions (plain and `stream: true`), POST /v1/messages (Anthropic,
plain and `stream: true`), POST /v1/messages/count_tokens, GET /v1/models,
GET and HEAD / (a reachability check),
POST /v1/sessions (open a session for an external agent; while a controller trains, only under a
negative task_index), POST /v1/sessions/{id}/reward (only for sessions that endpoint opened);
both need `Authorization: Bearer <admin_key>` when the gateway has one; POST
/v1/sessions/{id}/events (a process event the session's own agent reports, with its key;
`FORGERL_SESSION_ID` names the session to a controller's agent). Sessions opened there
expire after `session_idle_timeout_s` without a model call (a sweep, `Gateway.expire_idle`).
Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`, Anthropic-shaped on
/v1/messages routes; no traceback body.
A model call whose client disconnects is cancelled down to the engine and records nothing.
Every route takes its key as `Authorization: Bearer` or `x-api-key`; both naming different keys
is a 400 (`sessions_api.one_authorization`, CASES.md C26).
Run in-process: `server = await gateway.serve("127.0.0.1", 0)`; `server.base_url`. Authentication
and the sessions API are sessions_api.py's, error shapes and disconnects web.py's, the uvicorn
server server.py's.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from forgerl.gateway import core
from forgerl.gateway.conversation import Conversation
from forgerl.gateway.errors import GatewayError, parse_body
from forgerl.gateway.observe import Metrics, Observer, RequestLog
from forgerl.gateway.protocols import anthropic, chat, completions, responses
from forgerl.gateway.server import GatewayServer
from forgerl.gateway.sessions_api import (
    EventRequest,
    RewardRequest,
    SessionRequest,
    add_event,
    authenticate_key,
    one_authorization,
    open_external,
    require_admin,
    require_opener,
    reward_external,
)
from forgerl.gateway.web import InternalErrors, declare_bodies, error_response, unless_disconnected

__all__ = ["BODIES", "Gateway", "GatewayError", "GatewayServer", "create_app"]
R = TypeVar("R", bound=Response)

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": chat.ChatRequest, "/v1/completions": completions.CompletionRequest,
    "/v1/messages": anthropic.MessagesRequest, "/v1/messages/count_tokens":
    anthropic.PromptRequest, "/v1/responses": responses.ResponsesRequest,
    "/v1/sessions": SessionRequest, "/v1/sessions/{session_id}/reward": RewardRequest,
    "/v1/sessions/{session_id}/events": EventRequest}
"""The JSON body model of each POST route, for the OpenAPI document only: handlers parse the
raw body themselves (so errors keep the OpenAI/Anthropic shapes, never FastAPI's 422)."""


class Gateway(core.Gateway):
    """The gateway core (core.py) that can serve itself over HTTP (this module's app)."""

    async def serve(self, host: str = "127.0.0.1", port: int = 0,
                    request_log: str | Path | None = None, metrics: bool = True) -> GatewayServer:
        """Start the HTTP app inside the running event loop; port 0 picks a free port.
        `request_log`: the JSON-lines file of every request (observe.py; None: none), closed
        when the server stops. `metrics`: serve GET /metrics."""
        timeout = self.session_idle_timeout_s
        log = None if request_log is None else RequestLog(request_log)
        server = GatewayServer(create_app(self, log, metrics), host, port,
                               sweep=None if timeout is None else self.expire_idle,
                               sweep_every_s=min(1.0, (timeout or 1.0) / 4),
                               on_stop=None if log is None else log.close)
        await server.start()
        return server


async def _gateway_error(request: Request, e: GatewayError) -> JSONResponse:
    return error_response(request, e)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    return error_response(request, GatewayError(e.status_code, str(e.detail), code))


def noted(response: R, conversation: Conversation) -> R:
    """`response` with header `x-forgerl-approximated: field, ...` when the policy applied the
    closest exact behaviour for a control it lacks (fields.py; streamed answers too)."""
    if approximated := conversation.request.get("approximated"):
        response.headers["x-forgerl-approximated"] = ", ".join(approximated)
    return response


def create_app(gateway: core.Gateway, request_log: RequestLog | None = None,
               metrics: bool = True) -> FastAPI:
    """The FastAPI app over `gateway` (thin handlers, OpenAI-shaped errors); each request
    logged to `request_log` and counted in GET /metrics (when `metrics`; observe.py)."""
    app = FastAPI(title="ForgeRL gateway")
    declare_bodies(app, BODIES)
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(InternalErrors)
    counted = Metrics(gateway) if metrics else None
    if request_log is not None or counted is not None:  # added last: the outermost
        app.add_middleware(Observer, log=request_log, metrics=counted)
    if counted is not None:

        @app.get("/metrics")
        async def prometheus() -> Response:
            """Prometheus text format; no key needed (counts only: no keys, ids or text)."""
            return Response(counted.render(), media_type="text/plain; version=0.0.4")
    add_protocol_routes(app, gateway)
    add_model_routes(app, gateway)
    add_session_routes(app, gateway)
    return app


def add_protocol_routes(app: FastAPI, gateway: core.Gateway) -> None:
    """The model-call routes: chat, completions, messages (+ count_tokens), responses."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        """OpenAI chat completions (plain or SSE), recorded token-in-token-out."""
        session = authenticate_key(gateway, request.headers)
        req, conversation = chat.parse(await request.body(), gateway.strict)
        if req.stream:
            return noted(chat.respond_stream(req, gateway.stream(session, conversation)),
                         conversation)
        result = await unless_disconnected(request, gateway.complete(session, conversation),
                                           gateway.counters)
        return noted(chat.respond(req, result), conversation)

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Any:
        """OpenAI (legacy) completions of a text or token-id prompt, recorded as given."""
        session = authenticate_key(gateway, request.headers)
        body = await request.body()
        with gateway.active(session):  # a prompt surely over max_model_len: C09's event
            call = completions.parse(body, session, gateway.renderer, gateway.engine.max_model_len,
                                     gateway.strict)
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
        req, conversation = anthropic.parse(await request.body(), gateway.strict,
                                            functools.partial(gateway.prompt_tokens, session))
        if req.stream:
            return noted(anthropic.respond_stream(req, conversation, gateway.stream(
                session, conversation), gateway.renderer.decode), conversation)
        result = await unless_disconnected(request, gateway.complete(session, conversation),
                                           gateway.counters)
        return noted(anthropic.respond(req, conversation, result, gateway.renderer.decode),
                     conversation)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request) -> dict[str, int]:
        """Anthropic token counting: the next call's prompt length; nothing recorded."""
        session = authenticate_key(gateway, request.headers)
        conversation = anthropic.parse_prompt(await request.body(), gateway.strict,
                                              functools.partial(gateway.prompt_tokens, session))
        return {"input_tokens": gateway.prompt_tokens(session, conversation)}

    @app.post("/v1/responses")
    async def responses_create(request: Request) -> Any:
        """OpenAI Responses (plain or SSE), recorded token-in-token-out."""
        session = authenticate_key(gateway, request.headers)
        req, conversation = responses.parse(await request.body(), session, gateway.strict)
        if req.stream:
            return noted(responses.respond_stream(req, session, gateway.stream(
                session, conversation), gateway.responses_token_ids), conversation)
        result = await unless_disconnected(request, gateway.complete(session, conversation),
                                           gateway.counters)
        return noted(responses.respond(req, session, result, gateway.responses_token_ids),
                     conversation)


def add_model_routes(app: FastAPI, gateway: core.Gateway) -> None:
    """GET /v1/models and /v1/models/{id}: the served policies, then the untrained names; GET and
    HEAD /: 200."""
    cards = {name: {"id": name, "object": "model", "created": 0, "owned_by": "forgerl"}
             for name in [gateway.model_name, *gateway.policies,
                          *sorted(gateway.untrained_models)]}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> dict[str, str]:
        """Reachability check on the base URL (Claude Code sends `HEAD /` before its calls)."""
        return {"status": "ok", "model": gateway.model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served model names."""
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        """A served name's card (`client.models.retrieve`); 404 `model_not_found` else."""
        if model_id not in cards:
            raise GatewayError(404, f"model {model_id!r} does not exist; serving "
                               f"{', '.join(map(repr, cards))}", "model_not_found", "model")
        return cards[model_id]


def add_session_routes(app: FastAPI, gateway: core.Gateway) -> None:
    """The sessions API (sessions_api.py): open, reward, report an event."""

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> dict[str, str]:
        """Open a session for an external agent: {session_id, api_key}."""
        require_opener(gateway, one_authorization(request.headers),
                       request.client.host if request.client else None)
        body = parse_body(await request.body(), SessionRequest)
        trajectory_id, api_key = open_external(gateway, body)
        return {"session_id": trajectory_id, "api_key": api_key}

    @app.post("/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> dict[str, Any]:
        """Finish an externally opened session's trajectory with its reward (status "failed",
        with its error, when the session recorded no call)."""
        require_admin(gateway, one_authorization(request.headers))
        body = parse_body(await request.body(), RewardRequest)
        if reward_external(gateway, session_id, body.reward) == "failed":
            return {"session_id": session_id, "status": "failed", "error": core.NO_CALL}
        return {"session_id": session_id, "status": "finished", "reward": body.reward}

    @app.post("/v1/sessions/{session_id}/events")
    async def event(session_id: str, request: Request) -> dict[str, Any]:
        """Record a process event that the session's own agent reports (Bearer: its key)."""
        session = authenticate_key(gateway, request.headers)
        body = parse_body(await request.body(), EventRequest)
        turn = add_event(gateway, session_id, session, body)
        return {"session_id": session_id, "turn": turn, "kind": body.kind, "value": body.value}
