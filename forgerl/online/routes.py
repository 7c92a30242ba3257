"""The online routes, mounted on the gateway's own app (`online_app`).

POST /v1/online/sessions (admin key): open a session; consent from the body's `consent` or the
    `X-ForgeRL-Consent: true|false` header (the body wins; neither: `[online]
    consent_default`); answers {session_id, api_key, consent}. Model calls then go to the
    gateway's normal routes with that key.
POST /v1/online/feedback (admin key): {session_id, score in [-1, 1]} or {session_id, outcome:
    "success" | "failure"} (reward 1 / 0), any time later; 404 `session_not_found`, 409
    `feedback_exists` (the first feedback stays).
GET /v1/online/status (admin key): versions, canary, counters, the last decision.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgerl.gateway.app import create_app
from forgerl.gateway.errors import GatewayError, parse_body
from forgerl.gateway.sessions_api import one_authorization, require_admin
from forgerl.gateway.web import declare_bodies
from forgerl.online.canary import ArmMiddleware
from forgerl.online.service import OnlineService

CONSENT_HEADER = "x-forgerl-consent"


class OnlineSessionRequest(BaseModel):
    """POST /v1/online/sessions body (may be empty)."""

    model_config = ConfigDict(extra="forbid")

    consent: bool | None = None


class FeedbackRequest(BaseModel):
    """POST /v1/online/feedback body: a score or an outcome, not both."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1, max_length=200)
    score: float | None = Field(None, ge=-1.0, le=1.0, allow_inf_nan=False)
    outcome: Literal["success", "failure"] | None = None

    @model_validator(mode="after")
    def _one(self) -> FeedbackRequest:
        if (self.score is None) == (self.outcome is None):
            raise ValueError("give exactly one of score and outcome")
        return self

    @property
    def reward(self) -> float:
        """The score, or 1.0 for "success" and 0.0 for "failure"."""
        return self.score if self.score is not None else float(self.outcome == "success")


def consent_of(request: Request, body: OnlineSessionRequest, default: bool) -> bool:
    """The session's consent (module docstring); 400 for a header other than true/false."""
    if body.consent is not None:
        return body.consent
    header = request.headers.get(CONSENT_HEADER)
    if header is None:
        return default
    if header.strip().lower() not in ("true", "false"):
        raise GatewayError(400, f"X-ForgeRL-Consent must be true or false, not {header!r}",
                           "invalid_value", "X-ForgeRL-Consent")
    return header.strip().lower() == "true"


def online_app(service: OnlineService, metrics: bool = True) -> FastAPI:
    """The gateway's app (`create_app`) with the online routes and the canary's arm
    middleware (outermost)."""
    gateway = service.gateway
    app = create_app(gateway, None, metrics)
    declare_bodies(app, {"/v1/online/sessions": OnlineSessionRequest,
                         "/v1/online/feedback": FeedbackRequest})

    @app.post("/v1/online/sessions")
    async def open_session(request: Request) -> dict[str, Any]:
        """Open a user session (module docstring)."""
        require_admin(gateway, one_authorization(request.headers))
        body = parse_body(await request.body(), OnlineSessionRequest)
        return service.open_session(consent_of(request, body, service.config.consent_default))

    @app.post("/v1/online/feedback")
    async def feedback(request: Request) -> dict[str, Any]:
        """A session's late feedback (module docstring)."""
        require_admin(gateway, one_authorization(request.headers))
        body = parse_body(await request.body(), FeedbackRequest)
        return await service.feedback(body.session_id, body.reward)

    @app.get("/v1/online/status")
    async def status(request: Request) -> dict[str, Any]:
        """The service's state (module docstring)."""
        require_admin(gateway, one_authorization(request.headers))
        return service.status()

    app.add_middleware(ArmMiddleware, engine=service.engine)
    return app
