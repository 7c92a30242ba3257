"""Server-sent events for every protocol: an SSE response over an async iterator of event strings.

Data flow: a protocol module maps `Gateway.stream` events (core.py) to its own SSE strings and
hands them to `EventStream`, which sends them as they come, watches the client's disconnect
(`disconnected`) and closes the iterator at the end, so an abandoned stream aborts its engine
calls at once and records nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import Response

from forgerl.gateway import telemetry
from forgerl.gateway.errors import GatewayError

log = logging.getLogger(__name__)


class EventStream(Response):
    """An SSE response over an async iterator of event strings, for any protocol.

    Headers go out with the first event (a GatewayError before it is a plain JSON error answer,
    through the app's handlers); a GatewayError or other failure after it becomes
    `error_event(e)` and the stream ends. The client's disconnect (watched for the whole call,
    the wait for the first event included) cancels the iteration; the iterator is closed when
    the response ends, whatever the reason, so `Gateway.stream` aborts its engine streams at
    once instead of at garbage collection.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], error_event: Callable[[GatewayError], str]):
        self.status_code, self.background = 200, None
        self.init_headers()  # no body: no Content-Length
        self.events, self.error_event = events, error_event

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with contextlib.aclosing(self.events) as events:
            pump = asyncio.ensure_future(self._pump(events, send))
            watch = asyncio.ensure_future(disconnected(receive))
            try:
                await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                if not pump.done():
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await pump
            if not pump.cancelled():
                pump.result()  # a GatewayError before the first event: the app answers it

    async def _pump(self, events: AsyncIterator[str], send: Any) -> None:
        first = await anext(events, None)
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            if first is not None:
                await send({"type": "http.response.body", "body": first.encode(),
                            "more_body": True})
            async for event in events:
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})
        except GatewayError as e:
            telemetry.note(error=e.message, code=e.code)
            await send({"type": "http.response.body", "body": self.error_event(e).encode(),
                        "more_body": True})
        except Exception as e:
            log.exception("stream failed")
            error = GatewayError(500, f"internal error ({type(e).__name__}); the gateway log "
                                 "has the details", "internal_error", type="server_error")
            telemetry.note(error=error.message, code=error.code)
            await send({"type": "http.response.body", "body": self.error_event(error).encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def disconnected(receive: Any) -> None:
    """Return once the HTTP client has gone (the ASGI server reports `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass
