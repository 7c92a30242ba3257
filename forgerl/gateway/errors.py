"""Gateway errors and request-body validation, shared by the core and every protocol.

A `GatewayError` carries an HTTP status and the OpenAI error fields; the app answers it as
`{"error": {"message", "type", "param", "code"}}`; on the Anthropic Messages routes as
`{"type": "error", "error": {"type", "message"}}` (`anthropic_response`). Raised anywhere below
the handlers, it means nothing was recorded by the failing call.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from forgerl.config import first_error


class Loose(BaseModel):
    """A nested wire object: fields the protocol does not read are kept, not refused (only the
    top level of a request forbids unknown fields)."""

    model_config = ConfigDict(extra="allow")


class GatewayError(Exception):
    """An error answered to the client as OpenAI JSON with an HTTP status.

    param: the request field at fault (dotted path for nested fields), None when none is.
    anthropic_message: the message in Anthropic's own words where they differ (an overflow).
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
        anthropic_message: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = (
            status, message, code, param, type)
        self.anthropic_message = anthropic_message or message

    def response(self) -> JSONResponse:
        """The OpenAI-shaped JSON error body with this error's HTTP status."""
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)

    def anthropic_response(self) -> JSONResponse:
        """The Anthropic-shaped body `{"type": "error", "error": {"type", "message"}}` (the
        Messages routes), its `type` named from the HTTP status."""
        kind = ANTHROPIC_TYPES.get(self.status,
                                   "api_error" if self.status >= 500 else "invalid_request_error")
        body = {"type": "error", "error": {"type": kind, "message": self.anthropic_message}}
        return JSONResponse(body, status_code=self.status)

    def response_for(self, path: str) -> JSONResponse:
        """The answer to a request for `path`: Anthropic-shaped on the Messages routes
        (/v1/messages...), OpenAI-shaped elsewhere."""
        return self.anthropic_response() if path.startswith("/v1/messages") else self.response()


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 529: "overloaded_error"}


def unsupported(param: str, message: str) -> GatewayError:
    """A 400 `unsupported_value` for a field the gateway cannot honour as given."""
    return GatewayError(400, f"{param}: {message}", "unsupported_value", param)


def missing(param: str) -> GatewayError:
    """A 400 `missing_required_parameter` naming `param`, in OpenAI's words."""
    return GatewayError(400, f"Missing required parameter: '{param}'.",
                        "missing_required_parameter", param)


M = TypeVar("M", bound=BaseModel)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def context_exceeded(tokens: str, max_model_len: int, param: str) -> GatewayError:
    """400 `context_length_exceeded` (CASES.md C09): a prompt of `tokens` ("812", "at least
    76923") does not fit in `max_model_len`, in each API's own words, which the harnesses
    parse to compact their context: OpenAI's "This model's maximum context length is M
    tokens. However, your messages resulted in N tokens. ..." and Anthropic's "prompt is too
    long: N tokens > M maximum"."""
    return GatewayError(400, f"This model's maximum context length is {max_model_len} tokens. "
                        f"However, your messages resulted in {tokens} tokens. Please reduce "
                        "the length of the messages.", "context_length_exceeded", param,
                        anthropic_message=f"prompt is too long: {tokens} tokens > "
                        f"{max_model_len} maximum")


OUT_OF_RANGE = {"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                "finite_number", "too_short", "too_long", "string_too_short", "string_too_long",
                "literal_error", "enum", "string_pattern_mismatch"}
"""pydantic error types of a value of the right type but not an allowed one (`invalid_value`)."""


def parse_body(raw: bytes, schema: type[M]) -> M:
    """Validate a JSON body strictly ("8" is no integer, true no number, "yes" no boolean);
    malformed JSON, wrong types and values out of range are 400s (as OpenAI answers), coded
    `invalid_json`, `invalid_type` and `invalid_value` (`OUT_OF_RANGE`), with `param` the field's
    dotted path in the body (`config.first_error`: the deepest field, no union member names).

    A field the schema forbids (`extra="forbid"`) is a 400 `unknown_parameter` naming it. A
    lone UTF-16 surrogate escape ("\\ud83d", a JavaScript string cut inside an emoji) becomes
    U+FFFD, as a UTF-8 decoder replaces a broken sequence, instead of failing the call.
    """
    try:
        return schema.model_validate_json(raw or b"{}", strict=True)
    except ValidationError as e:
        errors = e.errors()
        err, param = errors[0], None
        if err.get("type") == "json_invalid":
            if fixed := _without_lone_surrogates(raw):
                return parse_body(fixed, schema)
        else:
            err, param = first_error(errors, _tree(raw))
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            raise GatewayError(400, f"Unrecognized request argument supplied: {param}",
                               "unknown_parameter", param) from None
        code = ("invalid_json" if kind == "json_invalid" else
                "invalid_value" if kind in OUT_OF_RANGE else "invalid_type")
        value, msg = err.get("input"), err.get("msg")
        if isinstance(value, float) and not math.isfinite(value):  # NaN is no "> 2" problem
            msg, code = "Input should be a finite number", "invalid_value"
        raise GatewayError(400, f"{param or 'body'}: {msg}", code, param or None) from None


def loads_json_text(text: str) -> Any:
    """`json.loads(text)` with each lone UTF-16 surrogate escape as U+FFFD, as in request
    bodies (`parse_body`): JSON text inside a field (a tool call's arguments) reaches the
    tokenizer, which fails on a lone surrogate. Raises what json.loads raises: ValueError
    (malformed, or an integer of over 4,300 digits) or RecursionError (nested too deeply)."""
    value = json.loads(text)
    if "\\ud" in text.lower() and (fixed := _lone_surrogates_replaced(value)):
        return json.loads(fixed)
    return value


def _lone_surrogates_replaced(value: Any) -> str | None:
    """`value` as JSON text with each lone surrogate as U+FFFD; None when it holds none."""
    text = json.dumps(value, ensure_ascii=False)  # the stdlib keeps lone surrogates
    fixed = LONE_SURROGATE.sub("\ufffd", text)
    return fixed if fixed != text else None


def _tree(raw: bytes) -> Any:
    """The body as a JSON tree for `error_location` (None when the stdlib cannot read it)."""
    try:
        return json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        return None


def _without_lone_surrogates(raw: bytes) -> bytes | None:
    """`raw` with each lone surrogate as U+FFFD; None when it has none. Raises GatewayError 400
    `invalid_json` with the stdlib's message when it is not JSON for another reason too (the
    validator stops at the surrogate and would name it instead)."""
    if b"\\ud" not in raw.lower():
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise GatewayError(400, f"body: Invalid JSON: {e}", "invalid_json") from None
    fixed = _lone_surrogates_replaced(value)
    return fixed.encode() if fixed else None
