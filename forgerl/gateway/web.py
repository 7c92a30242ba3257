"""The HTTP plumbing under the routes: error shapes, disconnects, internal errors, OpenAPI bodies.

Data flow: app.py builds the FastAPI app with these: `error_response` answers a `GatewayError`
OpenAI-shaped (Anthropic-shaped on /v1/messages routes), `InternalErrors` turns an unexpected
exception into a 500 on a connection that stays open, `unless_disconnected` cancels a plain model
call whose client left (nothing is recorded then), `declare_bodies` puts each POST route's body
model into the OpenAPI document (handlers parse raw bodies themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from forgerl.datapool.base import PoolLost
from forgerl.gateway import telemetry
from forgerl.gateway.errors import GatewayError
from forgerl.gateway.sse import disconnected

log = logging.getLogger(__name__)
R = TypeVar("R")


def error_response(request: Request, e: GatewayError) -> JSONResponse:
    """`e.response_for` the request's path (each API's own error shape); noted for the
    request log (error, code, and the field refused by a 400 other than a context overflow)."""
    telemetry.note(error=e.message, code=e.code)
    if e.status == 400 and e.param and e.code != "context_length_exceeded":
        telemetry.note(refused=e.param)
    return e.response_for(request.url.path)



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
    watcher = asyncio.ensure_future(disconnected(request.receive))
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


def declare_bodies(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> None:
    """Declare every POST route's request body (`bodies`: the JSON body model of each route)
    in `app.openapi()`."""
    refs, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                    ref_template="#/components/schemas/{model}")
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = build()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            for path, model in bodies.items():
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
    began (a stream) is re-raised: only the server can end that response. A lost pool server
    (`PoolLost`) is a 503 `pool_unavailable`, logged in one line once, without a traceback."""

    def __init__(self, app: Callable[..., Coroutine[Any, Any, None]]) -> None:
        self.app = app
        self.pool_lost = False  # a lost pool server is logged once (`PoolLost`)

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
            if isinstance(e, PoolLost):  # one line, once, not a traceback per request
                if not self.pool_lost:
                    log.error("%s", e)
                self.pool_lost = True
                error = GatewayError(503, "the data pool is unavailable; retry later",
                                     "pool_unavailable", type="server_error")
            else:
                log.exception("unexpected gateway error")
                error = GatewayError(
                    500, f"internal error ({type(e).__name__}); the gateway log has the details",
                    "internal_error", type="server_error")
            response = error_response(Request(scope), error)
            await response(scope, receive, send)
