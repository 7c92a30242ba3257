"""The engine the online gateway calls: the incumbent policy, or for a canary session the
candidate's.

A session is put in an arm when it opens (`CanaryEngine.assign`: the candidate with
probability `share` while a canary runs); every model call of that session then runs on its
arm's engine and records that engine's weight version. `ArmMiddleware` (outermost on the app)
reads the call's API key and sets the arm in a context variable that `CanaryEngine` reads, so
the gateway core needs no change. When the canary ends (promotion or rollback) every session,
canary ones included, is served by the incumbent engine.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
from starlette.datastructures import Headers

from forgerl.engines.base import RolloutEngine, TokenEvent
from forgerl.types import GenerateOutput, SamplingParams

_arm: ContextVar[int | None] = ContextVar("forgerl_online_arm", default=None)
"""The candidate weight version the current request's session was assigned, None: incumbent."""


class CanaryEngine:
    """A `RolloutEngine` over two engines: `incumbent` serves, `candidate` takes the canary.

    share: the fraction of sessions opened during a canary that it serves (0..1).
    canary: the candidate weight version under canary, None when none runs.
    arms: API key → the candidate version it was assigned (only canary sessions).
    """

    def __init__(self, incumbent: RolloutEngine, candidate: RolloutEngine, share: float,
                 seed: int = 0) -> None:
        self.incumbent, self.candidate, self.share = incumbent, candidate, share
        self.max_model_len = incumbent.max_model_len
        self.canary: int | None = None
        self.arms: dict[str, int] = {}
        self._rng = random.Random(seed)

    def assign(self, api_key: str) -> int | None:
        """Draw the arm of a new session: the candidate version (probability `share` while a
        canary runs) or None (the incumbent)."""
        if self.canary is None or self._rng.random() >= self.share:
            return None
        self.arms[api_key] = self.canary
        return self.canary

    def engine(self) -> RolloutEngine:
        """The engine of the current request's arm (the incumbent outside a canary)."""
        arm = _arm.get()
        return self.candidate if arm is not None and arm == self.canary else self.incumbent

    @property
    def weight_version(self) -> int:
        """The version the current request is stamped with (its arm's engine)."""
        return self.engine().weight_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """The arm's engine's `generate`."""
        return await self.engine().generate(prompt_ids, params)

    def stream(self, prompt_ids: list[int], params: SamplingParams
               ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """The arm's engine's `stream`."""
        return self.engine().stream(prompt_ids, params)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load weights into the incumbent (a promotion)."""
        await self.incumbent.update_weights(state_dict, version)

    async def close(self) -> None:
        """Close both engines."""
        await self.incumbent.close()
        await self.candidate.close()


class ArmMiddleware:
    """ASGI middleware: the request's session arm (`CanaryEngine.arms` by its Bearer or
    x-api-key key) into the context the engine reads; every answer carries
    `x-forgerl-weight-version`, its arm's engine version when the answer starts."""

    def __init__(self, app: Any, engine: CanaryEngine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            key = headers.get("x-api-key") or headers.get("authorization", "").partition(" ")[2]
            _arm.set(self.engine.arms.get(key.strip()))

            async def versioned(message: dict) -> None:
                if message["type"] == "http.response.start":
                    version = str(self.engine.weight_version).encode()
                    message["headers"] = [*message.get("headers", []),
                                          (b"x-forgerl-weight-version", version)]
                await send(message)

            await self.app(scope, receive, versioned)
            return
        await self.app(scope, receive, send)
