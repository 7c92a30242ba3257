"""No hidden concurrency cap (CASES.md C20): 300 sessions, one chat call each at the same moment.

Over real HTTP with one official `AsyncOpenAI` client per session (as 300 agent processes would
have), the engine must see all 300 calls in flight at once: nothing in the gateway (uvicorn's
limits, a lock, a connection pool) serialises them. The engine here answers only once every call
has arrived, so a cap anywhere below 300 makes the test fail by its deadline instead of passing
slowly. 0 errors, and each session records exactly its own answer.
"""

from __future__ import annotations

import asyncio

import openai

from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import ScriptedEngine, reply

N = 300


class Gate(ScriptedEngine):
    """Answers no call before `N` calls are in flight (or `deadline_s` passed)."""

    def __init__(self, script, deadline_s: float = 60.0):
        super().__init__(script)
        self.in_flight = self.peak = 0
        self.deadline_s = deadline_s
        self.all_in: asyncio.Event | None = None

    async def generate(self, prompt_ids, params):
        self.all_in = self.all_in or asyncio.Event()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if self.in_flight == N:
            self.all_in.set()
        try:
            await asyncio.wait_for(self.all_in.wait(), self.deadline_s)
            return await super().generate(prompt_ids, params)
        finally:
            self.in_flight -= 1


def test_300_simultaneous_sessions_are_all_in_flight_at_the_engine(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    answer = reply(r, "ok")
    srv = serve(Gate([answer] * N), tokenizer)
    sessions = [srv.session(task_index=i) for i in range(N)]

    async def one(key: str) -> str:
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0,
                                      timeout=120) as client:
            out = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])
            return out.choices[0].message.content

    async def burst() -> list[str | BaseException]:
        return await asyncio.gather(*[one(key) for _, key in sessions], return_exceptions=True)

    results = asyncio.run(burst())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    assert srv.engine.peak == N
    assert results == ["ok"] * N
    for tid, _ in sessions:
        (turn,) = srv.pool.get_trajectory(tid).completions
        assert turn.completion_ids == answer.ids
