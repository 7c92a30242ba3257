"""The request policy for real traffic (issue 46 items 1-2), over real HTTP.

Pins:
- The real first and second requests of Claude Code 2.1.197 (Anthropic Messages, streamed,
  `?beta=true`, a system message inside `messages`, thinking adaptive, output_config.effort,
  context_management clear_thinking keep all, metadata) and Codex CLI 0.171.0 (Responses,
  streamed, developer items, client_metadata, reasoning summary, include, prompt_cache_key,
  store false, a namespace and a web_search tool), captured by the "clitests" helper and
  trimmed (tests/gateway/fixtures/cli_requests/), get a 200; the turn records what was kept,
  approximated, left out and applied; the `x-forgerl-approximated` header names the
  approximated fields; turn 2 extends turn 1's prompt + completion ids id for id.
- Streams open at once: with an engine that answers after 2 s, the headers of every streaming
  protocol arrive within 0.5 s; a check that fails before sampling is still a plain HTTP 400.
- Context overflow in each API's own words: OpenAI's `context_length_exceeded` message with the
  exact prompt length, Anthropic's `prompt is too long: N tokens > M maximum`, which Claude
  Code's own pattern parses.
- A template that renders a system message only first: later system messages become user
  messages with a fixed prefix and leading ones merge, and turn 2 still extends turn 1.
- `clear_tool_uses_20250919` clears old tool results past its trigger (a new branch, recorded
  as applied); `clear_at_least` keeps the context when too little would be cleared.
- `[gateway] strict = true` keeps the refusals: unknown fields, approximated fields and
  server tools are 400s naming them; nothing is recorded.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from forgerl.gateway.edits import CLEARED
from forgerl.gateway.fields import AS_USUAL, MESSAGES, NO_REASONING, RESPONSES, small
from forgerl.gateway.renderers.templates import SYSTEM_AS_USER

from .conftest import Scripted, ScriptedEngine, render, reply
from .test_templates import serve_hf
from .test_tito import tool_call_text

FIXTURES = Path(__file__).parent / "fixtures" / "cli_requests"
CLAUDE_CODE_OVERFLOW = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)
"""The pattern Claude Code 2.1.197 reads an overflow's numbers with (from its bundle)."""


def captured(name: str) -> tuple[str, dict, dict]:
    """(path, headers without auth, JSON body) of a captured CLI request."""
    d = json.loads((FIXTURES / f"{name}.json").read_text())
    drop = {"x-api-key", "authorization", "content-length", "accept-encoding"}
    return d["path"], {k: v for k, v in d["headers"].items() if k.lower() not in drop}, d["body"]


def post(srv, key: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    auth = {"x-api-key": key} if path.startswith("/v1/messages") else {
        "Authorization": f"Bearer {key}"}
    return httpx.post(srv.base_url.removesuffix("/v1") + path, json=body, timeout=60,
                      headers={**(headers or {}), **auth})


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: {")]


def extends(first, second) -> bool:
    head = first.prompt_ids + first.completion_ids
    return second.prompt_ids[: len(head)] == head and second.extends_previous


def test_claude_code_requests(serve, tokenizer, renderer):
    write = tool_call_text("Write", {"file_path": "hello.txt", "content": "hi"})
    srv = serve(ScriptedEngine([reply(renderer, write), reply(renderer, "Done.")],
                               max_model_len=16384), tokenizer)
    tid, key = srv.session()
    path, headers, body = captured("claude-messages-1")
    assert path == "/v1/messages?beta=true" and body["messages"][1]["role"] == "system"
    r = post(srv, key, path, body, headers)
    assert r.status_code == 200, r.text
    assert r.headers["x-forgerl-approximated"] == "output_config.effort"
    starts = [e["content_block"] for e in events(r) if e["type"] == "content_block_start"]
    assert [(b["type"], b["name"]) for b in starts] == [("tool_use", "Write")]
    r = post(srv, key, *captured("claude-messages-2")[::2], headers)
    assert r.status_code == 200 and "".join(
        e["delta"].get("text", "") for e in events(r) if "delta" in e) == "Done."
    one, two = srv.pool.get_trajectory(tid).completions
    assert extends(one, two)
    mid = f"<|im_start|>system\n{body['messages'][1]['content']}<|im_end|>"
    assert mid in tokenizer.decode(one.prompt_ids)  # the system message where it was sent
    assert one.request == {
        "protocol": "messages", "kept": {"metadata": body["metadata"]},
        "approximated": {"output_config.effort": AS_USUAL},
        "applied": [{"type": "clear_thinking_20251015", "cleared": 0}]}


def test_codex_requests(serve, tokenizer, renderer):
    call = tool_call_text("exec_command", {"cmd": "printf hi > hello.txt"})
    srv = serve(ScriptedEngine([reply(renderer, call), reply(renderer, "Done.")],
                               max_model_len=16384), tokenizer)
    tid, key = srv.session()
    path, headers, body = captured("codex-responses-1")
    r = post(srv, key, path, body, headers)
    assert r.status_code == 200, r.text
    assert r.headers["x-forgerl-approximated"] == "reasoning"
    done = [e["item"] for e in events(r) if e["type"] == "response.output_item.done"]
    assert [(i["type"], json.loads(i["arguments"])) for i in done] == [
        ("function_call", {"cmd": "printf hi > hello.txt"})]
    r = post(srv, key, *captured("codex-responses-2")[::2], headers)
    assert r.status_code == 200 and "response.completed" in r.text
    one, two = srv.pool.get_trajectory(tid).completions
    assert extends(one, two)
    assert one.request == {
        "protocol": "responses", "approximated": {"reasoning": NO_REASONING},
        "kept": {k: small(body[k]) for k in ("client_metadata", "prompt_cache_key", "include",
                                             "store")},
        "left_out": ["namespace:multi_agent_v1", "web_search"]}
    assert "multi_agent" not in tokenizer.decode(one.prompt_ids)  # not rendered
    assert "exec_command" in tokenizer.decode(one.prompt_ids)


STREAMS = {  # path -> a minimal streamed body
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
}


def test_stream_headers_come_before_the_first_token(serve, tokenizer, renderer):
    slow = reply(renderer, "ok")
    srv = serve(ScriptedEngine([Scripted(slow.ids, slow.logprobs, delay_s=2)] * 5), tokenizer)
    _, key = srv.session()
    for path, body in STREAMS.items():  # each left once its headers came (the call cancelled)
        t0 = time.perf_counter()
        with httpx.stream("POST", srv.base_url.removesuffix("/v1") + path, timeout=30,
                          json={"model": "tiny", "stream": True, **body},
                          headers={"x-api-key": key, "Authorization": f"Bearer {key}"}) as r:
            waited = time.perf_counter() - t0
        assert r.status_code == 200 and waited < 0.5, (path, waited)
    t0 = time.perf_counter()  # and the rest comes once the engine answers
    r = post(srv, key, "/v1/chat/completions", {"model": "tiny", "stream": True,
                                                **STREAMS["/v1/chat/completions"]})
    assert time.perf_counter() - t0 >= 2 and "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events(r) if e["choices"]) == "ok"
    # a bad field is still a plain 400 before any stream begins
    r = post(srv, key, "/v1/chat/completions", {"model": "tiny", "stream": True,
             "messages": [{"role": "user", "content": "hi"}], "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_overflow_in_each_api_words(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([], max_model_len=64), tokenizer)
    _, key = srv.session()
    user = [{"role": "user", "content": "x" * 60}]
    n = len(render(renderer, user))  # one id per byte: the exact prompt length
    assert n > 64
    r = post(srv, key, "/v1/chat/completions", {"model": "tiny", "messages": user,
                                                "stream": True})
    assert r.status_code == 400 and r.json()["error"] == {
        "code": "context_length_exceeded", "param": "messages", "type": "invalid_request_error",
        "message": f"This model's maximum context length is 64 tokens. However, your messages "
                   f"resulted in {n} tokens. Please reduce the length of the messages."}
    r = post(srv, key, "/v1/responses", {"model": "tiny", "input": user})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(srv, key, "/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": user,
                                        "stream": True})
    assert r.status_code == 400 and r.json()["error"] == {
        "type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > 64 maximum"}
    assert CLAUDE_CODE_OVERFLOW.search(r.json()["error"]["message"]).groups() == (str(n), "64")


def test_system_messages_where_the_template_takes_one_only_first(serve):
    srv, r = serve_hf(serve, "qwen", ["ok", "fine", "ok"])
    assert not r.late_system and srv.renderer is r
    tid, key = srv.session()
    turn1 = [{"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."}]
    for messages in (turn1, [*turn1, {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "more"}]):
        resp = post(srv, key, "/v1/messages", {"model": "tiny", "max_tokens": 9,
                                               "messages": messages})
        assert resp.status_code == 200, resp.text
    one, two = srv.pool.get_trajectory(tid).completions
    assert extends(one, two)
    assert f"<|im_start|>user\n{SYSTEM_AS_USER}Be brief.<|im_end|>" in r.tokenizer.decode(
        one.prompt_ids)
    # leading system (developer) messages merge into the one system message
    developer = [{"role": "developer", "content": "A"}, {"role": "developer", "content": "B"}]
    resp = post(srv, key, "/v1/responses", {"model": "tiny", "input": [
        *developer, {"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    prompt = srv.pool.get_trajectory(tid).completions[-1].prompt_ids
    assert prompt == r.tokenizer.apply_chat_template(
        [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("least, cleared", [(None, 1), (10_000, 0)])
def test_clear_tool_uses_applies_past_its_trigger(serve, tokenizer, renderer, least, cleared):
    calls = [tool_call_text("get_weather", {"city": c}) for c in ("Paris", "Rome")]
    srv = serve(ScriptedEngine([reply(renderer, x) for x in [*calls, "Sunny."]]), tokenizer)
    tid, key = srv.session()
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
                                                            "value": TRIGGER},
            "keep": {"type": "tool_uses", "value": 1}}
    if least:
        edit["clear_at_least"] = {"type": "input_tokens", "value": least}
    body = {"model": "tiny", "max_tokens": 200, "context_management": {"edits": [edit]},
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}]}
    for k, city in enumerate(("", "Paris", "Rome")):
        if city:
            body["messages"] += [
                {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{k}",
                                                   "name": "get_weather",
                                                   "input": {"city": city}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}",
                                              "content": f"{city}: 22 C and sunny"}]}]
        assert post(srv, key, "/v1/messages", body).status_code == 200
    one, two, three = srv.pool.get_trajectory(tid).completions
    assert len(two.prompt_ids) <= TRIGGER < len(three.prompt_ids)  # fires on turn 3 only
    assert [c.request["applied"][0]["cleared"] for c in (one, two, three)] == [0, 0, cleared]
    text = tokenizer.decode(three.prompt_ids)
    assert (CLEARED in text, "Paris: 22 C" in text) == (bool(cleared), not cleared)
    assert "Rome: 22 C" in text  # the last tool use is kept
    assert extends(one, two) and extends(two, three) is not bool(cleared)  # a new branch


TRIGGER = 650
"""Input tokens between turn 2's and turn 3's prompt in the test above (one id per byte)."""


WEB = {"type": "web_search_20250305", "name": "web_search"}
BASE = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses": {"input": "hi"},
        "/v1/messages": {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}}


@pytest.mark.parametrize("path, body, notes", [
    ("/v1/chat/completions", {"reasoning_effort": "high", "verbosity": "low", "frobnicate": 1,
                              "web_search_options": {}},
     {"kept": {"frobnicate": 1}, "left_out": ["web_search_options"],
      "approximated": {"reasoning_effort": NO_REASONING, "verbosity": AS_USUAL}}),
    ("/v1/responses", {"seed": 1, "tools": [{"type": "web_search"}], "truncation": "auto",
                       "reasoning": {"effort": "high"}, "text": {"verbosity": "low"}},
     {"kept": {"seed": 1}, "left_out": ["web_search"], "approximated": {
         "reasoning": NO_REASONING, "text.verbosity": AS_USUAL,
         "truncation": RESPONSES["truncation"].note}}),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 2048}, "frobnicate": 1,
                      "tools": [WEB, {"type": "mcp_toolset", "mcp_server_name": "m"}],
                      "mcp_servers": [{"type": "url", "url": "https://m", "name": "m"}]},
     {"kept": {"frobnicate": 1, "mcp_servers": [{"type": "url", "url": "https://m", "name": "m"}]},
      "left_out": ["web_search_20250305:web_search", "mcp_toolset"],
      "approximated": {"thinking": MESSAGES["thinking"].note}}),
])
def test_controls_without_an_exact_match_are_approximated_and_recorded(
        serve, tokenizer, renderer, path, body, notes):
    """Fields that were 400s before the real-traffic policy: the reply is sampled from the
    prompt the request renders without them, and the turn says what was done."""
    srv = serve(ScriptedEngine([reply(renderer, "ok")]), tokenizer)
    tid, key = srv.session()
    r = post(srv, key, path, {"model": "tiny", **BASE[path], **body})
    assert r.status_code == 200, r.text
    assert r.headers["x-forgerl-approximated"] == ", ".join(notes["approximated"])
    (rec,) = srv.pool.get_trajectory(tid).completions
    protocol = {"/v1/chat/completions": "chat"}.get(path, path.removeprefix("/v1/"))
    assert rec.request == {"protocol": protocol, **notes}
    assert rec.prompt_ids == render(renderer, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/messages", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/responses", {"reasoning": {"effort": "high"}}, "reasoning"),
    ("/v1/responses", {"seed": 1}, "seed"),
    ("/v1/responses", {"truncation": "auto"}, "truncation"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ("/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0.type"),
])
def test_strict_refuses_what_it_would_approximate(serve, tokenizer, path, body, param):
    srv = serve(ScriptedEngine([]), tokenizer, strict=True)
    tid, key = srv.session()
    r = post(srv, key, path, {"model": "tiny", **BASE[path], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error.get("param", param) == param and param in error["message"]
    if param == "frobnicate":
        assert error["message"] == "Unrecognized request argument supplied: frobnicate"
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []
