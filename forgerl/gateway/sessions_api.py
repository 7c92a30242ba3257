"""The sessions API and authentication: who may call, and sessions that outside agents open.

Data flow: app.py's routes --> `authenticate` / `authenticate_key` (a session's bearer key, or
Anthropic's `x-api-key`, names its `Session`) and `require_admin` (the admin key of
POST /v1/sessions and the reward endpoint) --> `open_external` (POST /v1/sessions),
`reward_external` (POST /v1/sessions/{id}/reward), `add_event` (POST /v1/sessions/{id}/events)
--> the gateway core's sessions and the data pool. Every refusal is a `GatewayError`; nothing in
the pool changes then.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets

from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers

from forgerl.gateway import telemetry
from forgerl.gateway.core import Gateway
from forgerl.gateway.errors import GatewayError
from forgerl.gateway.sessions import Session
from forgerl.types import UNDELIVERED


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
    telemetry.note(session=session.trajectory_id)
    return session


def one_authorization(headers: Headers) -> str | None:
    """The request's one `Authorization` value, `x-api-key: K` read as `Bearer K` (Anthropic
    clients send their key so); None when neither is sent. Raises GatewayError 400
    `conflicting_api_keys` when the headers (each of them, however often sent) name more than
    one key (CASES.md C26): a request never lands in one of two sessions by header order."""
    keys = {f"Bearer {k.strip()}" for k in headers.getlist("x-api-key")}
    for value in headers.getlist("authorization"):
        scheme, _, key = value.partition(" ")
        keys.add(f"Bearer {key.strip()}" if scheme.lower() == "bearer" else value)
    if len(keys) > 1:
        raise GatewayError(400, "x-api-key and Authorization: Bearer name different keys; "
                           "send one key", "conflicting_api_keys")
    return next(iter(keys), None)


def require_admin(gateway: Gateway, authorization: str | None) -> None:
    """Check `Authorization: Bearer <admin_key>`; fails closed (CASES.md C26).

    Raises GatewayError 403 `permission_denied` when the gateway has no `admin_key` (the
    sessions API is closed; `forgerl gateway` and `forgerl train` always set one), 401
    `invalid_api_key` for a missing or wrong key; nothing recorded then.
    """
    if gateway.admin_key is None:
        raise GatewayError(403, "the sessions API is closed: this gateway has no admin key "
                           "([gateway] admin_key)", "permission_denied")
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
            key.strip().encode(), gateway.admin_key.encode()):
        msg = "missing admin key" if not authorization else "wrong admin key"
        raise GatewayError(401, f"{msg}: the sessions API needs Authorization: Bearer "
                           "<admin_key>", "invalid_api_key")


def require_opener(gateway: Gateway, authorization: str | None, host: str | None) -> None:
    """`require_admin` for POST /v1/sessions, except that a gateway with `loopback_sessions`
    also opens a session for a loopback client (`host`, 127.0.0.0/8 or ::1) that sends no
    Authorization header."""
    if gateway.loopback_sessions and authorization is None and host is not None:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(host).is_loopback:
                return
    require_admin(gateway, authorization)


def authenticate_key(gateway: Gateway, headers: Headers) -> Session:
    """The session named by `x-api-key: <api_key>` (Anthropic clients) or by
    `Authorization: Bearer <api_key>` (`one_authorization`: 400 `conflicting_api_keys` when
    they name different keys); 401 `invalid_api_key` for a missing, empty, unknown or closed
    key. Every session-keyed route authenticates so."""
    return authenticate(gateway, one_authorization(headers))


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
    telemetry.note(session=trajectory_id)
    return trajectory_id, api_key


def reward_external(gateway: Gateway, trajectory_id: str, reward: float) -> str:
    """POST /v1/sessions/{id}/reward: finish a session opened over HTTP with `reward`; returns
    the status stored ("failed" when it recorded no call: `Gateway.finish_session`).

    Raises GatewayError 404 (unknown id), 403 (not opened over HTTP: a controller rollout,
    whether its session is open, closed or its trajectory ended), 409 (already ended).
    Nothing in the pool changes when it raises.
    """
    telemetry.note(session=trajectory_id)
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
        return gateway.finish_session(trajectory_id, reward)
    except ValueError as e:
        raise GatewayError(409, str(e), "trajectory_not_running", "session_id") from None
