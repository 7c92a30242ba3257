"""Gateway fixtures: a scripted rollout engine, a data pool, and the app served over real HTTP.

`ScriptedEngine` answers each generate() with the next scripted (ids, logprobs), so tests can
make the engine emit ids that re-encoding would never produce (CASES.md C01). The app runs under
uvicorn on 127.0.0.1 (free port) in a background thread with its own event loop; tests talk to
it with the official `openai` client and httpx; completions land in a real SQLite pool file.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from forgerl.datapool.sqlite import SQLitePool
from forgerl.engines.base import TokenEvent
from forgerl.gateway.app import Gateway, GatewayServer
from forgerl.gateway.protocols import chat
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.types import GenerateOutput, SamplingParams

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Scripted:
    """One scripted engine answer: the ids and logprobs the engine 'samples'."""

    ids: list[int]
    logprobs: list[float]
    delay_s: float = 0.0
    """Seconds the engine 'decodes' before answering (a slow generation that can be cancelled)."""
    token_delay_s: float = 0.0
    """stream() only: seconds before each token is 'sampled' (after delay_s)."""


class ScriptedEngine:
    """A RolloutEngine test double: replays scripted completions, records every request.

    A scripted item longer than params.max_tokens is cut there with finish "length"; otherwise
    finish is "stop" when the last id is a stop id. An Exception item is raised instead.
    `cancelled` holds the time.monotonic() of every generate() cancelled during its delay, and
    of every stream() closed or cancelled before its GenerateOutput; `streamed` holds, per
    stream() call, the TokenEvents it yielded so far (what the engine 'computed').
    """

    def __init__(self, script: list[Scripted | Exception], max_model_len: int = 4096):
        self.script = list(script)
        self.max_model_len = max_model_len
        self.weight_version = 0
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.cancelled: list[float] = []
        self.streamed: list[list[TokenEvent]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        self.calls.append((list(prompt_ids), params))
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        try:
            await asyncio.sleep(item.delay_s)
        except asyncio.CancelledError:
            self.cancelled.append(time.monotonic())
            raise
        ids, lps = item.ids[: params.max_tokens], item.logprobs[: params.max_tokens]
        finish = "stop" if ids and ids[-1] in params.stop_token_ids else "length"
        return GenerateOutput(ids, lps, [self.weight_version] * len(ids), finish)

    async def stream(self, prompt_ids: list[int], params: SamplingParams):
        """generate() token by token: each scripted id after `token_delay_s`, then the output."""
        self.calls.append((list(prompt_ids), params))
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        events: list[TokenEvent] = []
        self.streamed.append(events)
        ids, lps = item.ids[: params.max_tokens], item.logprobs[: params.max_tokens]
        done = False
        try:
            await asyncio.sleep(item.delay_s)
            for t, lp in zip(ids, lps, strict=True):
                if item.token_delay_s:
                    await asyncio.sleep(item.token_delay_s)
                events.append(TokenEvent(t, lp, self.weight_version, time.perf_counter()))
                yield events[-1]
            finish = "stop" if ids and ids[-1] in params.stop_token_ids else "length"
            done = True
            yield GenerateOutput(ids, lps, [e.weight_version for e in events], finish)
        finally:
            if not done:
                self.cancelled.append(time.monotonic())

    async def update_weights(self, state_dict, version: int) -> None:
        self.weight_version = version

    async def close(self) -> None:
        pass


def render(renderer: ChatMLRenderer, messages: list[dict], tools: list[dict] | None = None,
           **kw) -> list[int]:
    """Prompt ids of chat-shaped messages and tools (translated as the chat endpoint does)."""
    return renderer.render(chat.messages(messages), chat.tools(tools or []), **kw)


def reply(renderer: ChatMLRenderer, text: str, end: bool = True) -> Scripted:
    """A scripted answer: text encoded + end-of-turn, logprob -0.01 * (position + 1)."""
    ids = renderer.encode(text) + ([renderer.end_of_turn_id] if end else [])
    return Scripted(ids, [-0.01 * (i + 1) for i in range(len(ids))])


ADMIN_KEY = "test-admin-key"
"""The admin key `serve` gives each gateway unless told otherwise (the sessions API needs one)."""


@dataclass
class Served:
    """A gateway served over HTTP: base_url for clients, the gateway and its parts."""

    gateway: Gateway
    base_url: str
    loop: asyncio.AbstractEventLoop
    server: GatewayServer

    @property
    def engine(self) -> ScriptedEngine:
        return self.gateway.engine  # type: ignore[return-value]

    @property
    def pool(self) -> SQLitePool:
        return self.gateway.pool  # type: ignore[return-value]

    @property
    def renderer(self) -> ChatMLRenderer:
        return self.gateway.renderer

    @property
    def admin(self) -> dict[str, str]:
        """The admin key's header, for POST /v1/sessions and the reward endpoint."""
        return {"Authorization": f"Bearer {self.gateway.admin_key}"}

    def session(self, task_index: int = 0, **kw) -> tuple[str, str]:
        """(trajectory_id, api_key) of a new session."""
        return self.gateway.open_session(task_index=task_index, **kw)

    def client(self, api_key: str):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60)

    def converse(self, first: str, turns: int, follow_up: Callable[[int], dict],
                 **create) -> tuple[str, str, list]:
        """(trajectory_id, api_key, responses) of a new session's `turns` chat calls through
        the openai SDK (model "tiny", temperature 1.0, seed = the turn's index, `create`'s
        arguments), each on the conversation so far: the user message `first`, then each reply
        followed by `follow_up(turn)`."""
        tid, key = self.session()
        client = self.client(key)
        messages: list[dict] = [{"role": "user", "content": first}]
        responses = []
        for turn in range(turns):
            r = client.chat.completions.create(model="tiny", messages=messages, temperature=1.0,
                                               seed=turn, **create)
            responses.append(r)
            messages += [r.choices[0].message.model_dump(exclude_none=True), follow_up(turn)]
        return tid, key, responses


@pytest.fixture
def renderer(tokenizer) -> ChatMLRenderer:
    return ChatMLRenderer(tokenizer)


@pytest.fixture
def serve(tmp_path) -> Iterator[Callable[..., Served]]:
    """Factory: serve(engine, tokenizer, renderer=None, request_log=None, pool=None,
    **gateway_kwargs) -> Served (a new SQLite pool unless `pool` is given; a ChatMLRenderer
    of `tokenizer` unless `renderer` is given; `request_log`: the request log's path,
    `Gateway.serve`; admin_key `ADMIN_KEY` unless given); stopped at teardown."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers: list[GatewayServer] = []
    pools: list[SQLitePool] = []

    def _serve(engine, tokenizer, default_system: str | None = None, renderer=None,
               request_log=None, pool=None, **kw) -> Served:
        kw.setdefault("model_name", "tiny")
        kw.setdefault("admin_key", ADMIN_KEY)
        pool = pool or SQLitePool(tmp_path / f"pool-{len(pools)}.sqlite")
        pools.append(pool)
        renderer = renderer or ChatMLRenderer(tokenizer, default_system)
        gateway = Gateway(renderer, engine, pool, **kw)
        server = asyncio.run_coroutine_threadsafe(
            gateway.serve("127.0.0.1", 0, request_log=request_log), loop).result(30)
        servers.append(server)
        return Served(gateway, server.base_url, loop, server)

    yield _serve
    for server in servers:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    for pool in pools:
        pool.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def served(serve, tokenizer, script: list[str | Scripted | Exception],
           connect: Callable[[Served, str], object] = Served.client, **engine_kw):
    """(served gateway, trajectory id, client) of a new session on a ScriptedEngine(script,
    **engine_kw) answering in order: a text as `reply(ChatMLRenderer(tokenizer), text)`, any
    other item as it is. `connect(served, api_key)` builds the client (default: openai's)."""
    renderer = ChatMLRenderer(tokenizer)
    items = [reply(renderer, x) if isinstance(x, str) else x for x in script]
    srv = serve(ScriptedEngine(items, **engine_kw), tokenizer)
    tid, key = srv.session()
    return srv, tid, connect(srv, key)
