"""A NeMo-Gym resources server written here in its format, for the adapter's tests (nemo_gym
itself needs Python >= 3.13): a FastAPI app with `/seed_session`, one POST endpoint per tool and
`/verify`, its request and response models shaped like nemo_gym 0.7.0's
`base_resources_server.py` (BaseRunRequest, BaseVerifyRequest with a Responses API `response`,
BaseVerifyResponse with `reward`, `mask_sample`), modelled on its example_session_state_mgmt
server: a counter per session (a cookie, as NeMo-Gym's session middleware keeps it), seeded from
the task row's `initial_count`; verify rewards 1.0 when it ends at `expected_count`. A row with
`"mask": true` makes verify report its own failure (mask_sample)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request, Response
from openai.types.responses import Response as OpenAIResponse
from pydantic import BaseModel, ConfigDict, Field

SESSION_COOKIE = "nemo_gym_session"


class OutputText(BaseModel):
    annotations: list[Any]
    text: str
    type: Literal["output_text"] = "output_text"


class OutputMessage(BaseModel):
    id: str
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    type: Literal["message"] = "message"


class FunctionToolCall(BaseModel):
    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(BaseModel):
    call_id: str
    output: str
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class NeMoGymResponse(OpenAIResponse):
    output: list[Annotated[OutputMessage | FunctionToolCall | FunctionCallOutput,
                           Field(discriminator="type")]]


class BaseRunRequest(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    responses_create_params: dict[str, Any]


class BaseVerifyRequest(BaseRunRequest):
    response: NeMoGymResponse


class BaseVerifyResponse(BaseVerifyRequest):
    reward: float
    mask_sample: bool = False
    failure_kind: str | None = None
    failure_reason: str | None = None


class CounterSeedSessionRequest(BaseModel):
    initial_count: int


class CounterVerifyRequest(BaseVerifyRequest):
    expected_count: int
    mask: bool = False


class IncrementCounterRequest(BaseModel):
    count: int


COUNTERS: dict[str, int] = {}
VERIFIED: list[BaseVerifyRequest] = []


def _session(request: Request) -> str:
    return request.cookies.get(SESSION_COOKIE, "")


app = FastAPI()


@app.post("/seed_session")
async def seed_session(request: Request, response: Response, body: CounterSeedSessionRequest):
    session = str(uuid.uuid4())
    COUNTERS[session] = body.initial_count
    response.set_cookie(SESSION_COOKIE, session)
    return {}


@app.post("/increment_counter")
async def increment_counter(request: Request, body: IncrementCounterRequest):
    COUNTERS[_session(request)] = COUNTERS.get(_session(request), 0) + body.count
    return {"success": True}


@app.post("/get_counter_value")
async def get_counter_value(request: Request):
    return {"count": COUNTERS.get(_session(request), 0)}


@app.post("/verify")
async def verify(request: Request, body: CounterVerifyRequest) -> BaseVerifyResponse:
    VERIFIED.append(body)
    reward = float(COUNTERS.get(_session(request)) == body.expected_count)
    if body.mask:
        return BaseVerifyResponse(**body.model_dump(), reward=0.0, mask_sample=True,
                                  failure_kind="resources_unavailable",
                                  failure_reason="the counter store is gone")
    return BaseVerifyResponse(**body.model_dump(), reward=reward)
