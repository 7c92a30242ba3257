"""The four coding-agent CLIs (Claude Code, Codex CLI, OpenCode, Pi), unmodified, through the real
gateway served over HTTP (issue 46 item 6; configuration in clis.py, docs/coding-clis.md).

Scripted engine: each CLI runs a full two-turn tool loop on every API it speaks. The engine
answers by reading the prompt, so parallel side calls (OpenCode's title generator) get their own
answer whatever the order: no tool section -> a title; a tool result present -> a final text;
else -> the CLI's own write-file tool call in the served renderer's (hermes) format.
Pins: exit code 0; the file the task asked for holds the content the scripted call wrote; the
task's turn 2 prompt extends turn 1's prompt + completion id for id; no 4xx/5xx was answered;
a side call is a trace of its own; statuses are read from the gateway's own request log.
Tiny model (Pi): its calls are answered 200 by the real LocalEngine and the CLI exits.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from forgerl.datapool.sqlite import SQLitePool
from forgerl.engines.local import LocalEngine
from forgerl.gateway.app import Gateway, create_app
from forgerl.gateway.observe import RequestLog
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.gateway.server import GatewayServer
from forgerl.types import Completion

from . import clis
from .conftest import ScriptedEngine, reply
from .test_tito import tool_call_text

FINAL, TITLE = "Done.", "Hello file"


@dataclass
class Live:
    """A gateway served over HTTP for one CLI run: root URL (no /v1), session, request log."""

    gateway: Gateway
    root_url: str
    trajectory_id: str
    key: str
    log: Path
    calls: list[str] = field(default_factory=list)

    @property
    def seen(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request in the gateway's request log, in order."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [(e["method"], e["path"], e["status"]) for e in map(json.loads, lines)]

    def completions(self) -> list[Completion]:
        return self.gateway.pool.get_trajectory(self.trajectory_id).completions

    def errors(self) -> list[tuple[str, str, int]]:
        return [s for s in self.seen if s[2] >= 400]


@pytest.fixture
def live(tmp_path, tokenizer) -> Iterator[Callable[..., Live]]:
    """Factory: live(engine, **gateway_kwargs) -> Live (a ChatML gateway on a SQLite pool,
    served on 127.0.0.1 with its request log, one open session); server and engine stopped at
    teardown."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started: list[tuple[GatewayServer, SQLitePool, object]] = []

    def _live(engine, **kw) -> Live:
        pool = SQLitePool(tmp_path / f"pool-{len(started)}.sqlite")
        gateway = Gateway(ChatMLRenderer(tokenizer), engine, pool, model_name=clis.MODEL, **kw)
        log = tmp_path / f"requests-{len(started)}.jsonl"
        server = GatewayServer(create_app(gateway, RequestLog(log)), "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        started.append((server, pool, engine))
        tid, key = gateway.open_session()
        return Live(gateway, f"http://127.0.0.1:{server.port}", tid, key, log)

    yield _live
    for server, pool, engine in started:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        asyncio.run_coroutine_threadsafe(engine.close(), loop).result(30)
        pool.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


class PromptEngine(ScriptedEngine):
    """A ScriptedEngine whose next answer is `answer(prompt text)`, chosen when a call arrives
    (so concurrent calls each get theirs); `prompts` keeps each call's decoded prompt."""

    def __init__(self, renderer: ChatMLRenderer, answer: Callable[[str], str]):
        super().__init__([], max_model_len=1 << 18)
        self.renderer, self.answer, self.prompts = renderer, answer, []

    def _next(self, prompt_ids: list[int]) -> None:
        text = self.renderer.decode(prompt_ids)
        self.prompts.append(text)
        self.script = [reply(self.renderer, self.answer(text))]

    async def generate(self, prompt_ids, params):
        self._next(prompt_ids)  # no await before the parent pops it
        return await super().generate(prompt_ids, params)

    async def stream(self, prompt_ids, params):
        self._next(prompt_ids)  # the parent pops it before its first await
        async for event in super().stream(prompt_ids, params):
            yield event


def answers(call_text: str) -> Callable[[str], str]:
    """The scripted policy: title for a tool-less call, final text after a tool result."""

    def answer(prompt: str) -> str:
        if "<tools>" not in prompt:
            return TITLE
        return FINAL if "<tool_response>" in prompt else call_text

    return answer


def task_turns(records: list[Completion], decode) -> tuple[Completion, Completion]:
    """(turn 1, turn 2) of the task: the call answered with the tool call, and the call whose
    prompt carries that call's result."""
    prompts = [decode(c.prompt_ids) for c in records]
    task = [(c, p) for c, p in zip(records, prompts, strict=True) if "<tools>" in p]
    first = [c for c, p in task if "<tool_response>" not in p]
    second = [c for c, p in task if "<tool_response>" in p]
    assert len(first) == 1 and len(second) == 1, [len(first), len(second)]
    return first[0], second[0]


@pytest.mark.parametrize(("cli", "api"), clis.cases())
def test_cli_two_turn_tool_loop(cli, api, live, tokenizer, tmp_path):
    renderer = ChatMLRenderer(tokenizer)
    workdir = tmp_path / f"{cli}-{api}-work"
    name, args = clis.write_call(cli, workdir)
    engine = PromptEngine(renderer, answers(tool_call_text(name, args)))
    srv = live(engine)
    run = clis.run(cli, api, srv.root_url, srv.key, tmp_path)
    out = f"exit {run.returncode}\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-2000:]}"
    assert srv.errors() == [], out
    assert run.returncode == 0, out
    if cli == "claude":  # its reachability check on the base URL, before the model calls
        assert srv.seen[0] == ("HEAD", "/", 200)
    assert (workdir / clis.FILE).read_text() == clis.CONTENT, out
    records = srv.completions()
    assert len(records) == len(engine.prompts) == len(srv.seen) - _other(srv)
    first, second = task_turns(records, renderer.decode)
    head = first.prompt_ids + first.completion_ids
    assert second.prompt_ids[: len(head)] == head
    assert first.completion_ids == reply(renderer, tool_call_text(name, args)).ids
    assert second.trace == first.trace
    side = [c for c in records if c is not first and c is not second]
    # Claude Code (nonessential traffic off), Codex and Pi send no side call; OpenCode a title.
    assert len(side) == (1 if cli == "opencode" else 0)
    # Depends on the "traces" helper: a call that extends no earlier one starts its own trace.
    assert {c.trace for c in side}.isdisjoint({first.trace}), [c.trace for c in records]


def _other(srv: Live) -> int:
    """Answered requests that are no model call (GET /v1/models, count_tokens)."""
    return sum(1 for _, path, _ in srv.seen
               if not path.endswith(("/messages", "/chat/completions", "/responses")))


@pytest.mark.parametrize("api", clis.APIS["pi"])
def test_cli_against_the_tiny_model(api, live, tiny_model, tmp_path):
    """The real LocalEngine (random tiny model, byte tokenizer) answers the CLI's call 200 and
    the CLI exits on its own; each call is recorded with 1..max_tokens sampled ids.

    Pi only: its prompt is about 6.5k byte-tokenizer tokens. OpenCode's (31k), Codex's (45k)
    and Claude Code's (80k) prompts take minutes to prefill on the tiny model on CPU (the
    engine's masked prefill attention is quadratic in memory), beyond a suite test's budget."""
    srv = live(LocalEngine(tiny_model, max_model_len=16384, max_batch_size=4), max_tokens=8)
    run = clis.run("pi", api, srv.root_url, srv.key, tmp_path)
    out = f"exit {run.returncode}\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-2000:]}"
    assert srv.errors() == [] and srv.seen, out
    records = srv.completions()
    assert len(records) == len(srv.seen) - _other(srv), out
    assert all(0 < len(c.completion_ids) <= 8 for c in records), out
