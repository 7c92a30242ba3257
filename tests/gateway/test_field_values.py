"""Malformed values inside fields the body schema lets through, found by a breaker session
(2026-12-05), all sent on one keep-alive connection, which must stay open throughout.

Pins: a Responses `text.format` that is no object is a 400 naming it; a tool schema whose
`$schema` is no string is a 400 `invalid_tool` on chat and on Anthropic's count_tokens (they
were 500s from inside jsonschema); tool-call arguments that json.loads cannot take (an integer
of 5,000 digits, 3,000 nested arrays) are rendered as strings, and an escaped lone surrogate in
them is rendered as U+FFFD (each was a 500); texts the C09 floor did not count (an assistant
reply, tool-call arguments, a tool description or schema) are refused before tokenizing
("at least" N tokens), an earlier reply's text before `</think>` included (ChatML renders it); an
unexpected exception is a 500 `internal_error` without its message, and the same connection
then serves the next request. Error params name the body's fields (no pydantic union members),
values out of range are `invalid_value` (vLLM's sampling extras with vLLM's bounds), NaN and
infinity are "not a finite number", and JSON that is malformed besides a lone surrogate escape
is reported for its real fault.
"""

from __future__ import annotations

import json

import httpx

from .conftest import ScriptedEngine, reply

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _with_call(arguments: str, content: str = "") -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "go"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}]


def test_malformed_field_values_on_one_keep_alive_connection(serve, tokenizer, renderer):
    engine = ScriptedEngine([reply(renderer, "ok")] * 4, max_model_len=16384)
    srv = serve(engine, tokenizer)
    _, key = srv.session()
    big = "x" * 1_000_000  # far over 16384 tokens at any tokenization
    with httpx.Client(base_url=srv.base_url.removesuffix("/v1"), timeout=60,
                      headers={"Authorization": f"Bearer {key}", "x-api-key": key}) as c:
        clients = set()

        def post(path: str, body: dict) -> httpx.Response:
            r = c.post(path, json={"model": "tiny", **body})
            clients.add(r.extensions["network_stream"].get_extra_info("client_addr"))
            assert "Traceback" not in r.text
            return r

        def error(path: str, body: dict, status: int = 400) -> dict:
            r = post(path, body)
            assert r.status_code == status, r.text
            return r.json()["error"]

        err = error("/v1/responses", {"input": "hi", "text": {"format": "text"}})
        assert (err["code"], err["param"]) == ("invalid_type", "text.format")
        # params name the body's fields, not pydantic's union members; ranges are values
        user = [{"role": "user", "content": "hi"}]
        for path, body, param, code in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
                 "messages.0.content", "invalid_type"),
                ("/v1/chat/completions", {"messages": user, "tool_choice": "bogus"},
                 "tool_choice", "invalid_value"),
                ("/v1/responses", {"input": 5}, "input", "invalid_type"),
                ("/v1/chat/completions", {"messages": user, "max_tokens": 0}, "max_tokens",
                 "invalid_value"),
                ("/v1/chat/completions", {"messages": user, "n": 129}, "n", "invalid_value"),
                # vLLM's sampling extras keep vLLM's bounds (CASES.md C21)
                ("/v1/chat/completions", {"messages": user, "top_k": -2}, "top_k",
                 "invalid_value"),
                ("/v1/chat/completions", {"messages": user, "repetition_penalty": 0},
                 "repetition_penalty", "invalid_value"),
                ("/v1/completions", {"prompt": "a", "min_p": 1.5}, "min_p", "invalid_value"),
                ("/v1/completions", {"prompt": "a", "top_k": 2.5}, "top_k", "invalid_type"),
                # a breaker's second round: the deepest real field, never a member's name
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]},
                 "messages.0.content", "invalid_type"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                    {"type": "text", "text": 5}]}]}, "messages.0.content.0.text", "invalid_type"),
                ("/v1/chat/completions", {"messages": user, "tool_choice": {
                    "type": "function", "function": {"name": 5}}}, "tool_choice.function.name",
                 "invalid_type"),
                ("/v1/chat/completions", {"messages": user, "stop": {"a": 1}}, "stop",
                 "invalid_type"),
                ("/v1/responses", {"input": [{"type": "message", "role": "bogus",
                                              "content": "x"}]}, "input.0.role",
                 "invalid_value")):
            err = error(path, body)
            assert (err["param"], err["code"]) == (param, code), err
        err = error("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": 5}]}]})
        assert "messages.0.content.0" in err["message"] and "other" not in err["message"]
        r = c.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": '
                   b'[{"role": "user", "content": "hi"}], "temperature": NaN}')
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "temperature: Input should be a finite number")
        r = c.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a", '
                   b'"repetition_penalty": Infinity}')
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "repetition_penalty: Input should be a finite number")
        r = c.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": '
                   b'[{"role": "user", "content": "\\ud800"}],}')  # the comma is the fault
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert "Expecting property name" in r.json()["error"]["message"]
        for schema in (5, [], {}):
            tool = {"type": "function",
                    "function": {"name": "f", "parameters": {"$schema": schema}}}
            err = error("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
            assert err["code"] == "invalid_tool" and "$schema must be a string" in err["message"]
        err = error("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}],
                                                  "tools": [{"name": "f", "input_schema":
                                                             {"$schema": 5}}]})
        assert err["type"] == "invalid_request_error" and "$schema" in err["message"]

        for arguments in ('{"a":' + "9" * 5000 + "}", "[" * 3000 + "]" * 3000):
            r = post("/v1/chat/completions", {"messages": _with_call(arguments), "tools": [TOOL]})
            assert r.status_code == 200, r.text
            # kept as the string it is (as any unparsable arguments), JSON-quoted in the call
            assert json.dumps(arguments) in tokenizer.decode(engine.calls[-1][0])
        r = post("/v1/chat/completions",
                 {"messages": _with_call('{"a": "\\ud800 \\ud83d\\ude00"}'), "tools": [TOOL]})
        assert r.status_code == 200, r.text
        assert '{"a": "\ufffd \U0001f600"}' in tokenizer.decode(engine.calls[-1][0])

        calls = len(engine.calls)
        for body in ({"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": big},
                                   {"role": "user", "content": "and?"}]},
                     {"messages": _with_call(json.dumps({"a": big})), "tools": [TOOL]},
                     {"messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"type": "function", "function": {"name": "f",
                                                                  "description": big}}]},
                     {"messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"type": "function", "function": {
                          "name": "f", "parameters": {"type": "object", "description": big}}}]}):
            err = error("/v1/chat/completions", body)
            assert err["code"] == "context_length_exceeded"
            assert "resulted in at least" in err["message"]  # the floor: nothing was tokenized
        # ChatML renders an earlier reply's text before </think> too: counted (a template that
        # drops it is test_templates'), so a 1 MB one is refused untokenized as well
        err = error("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": f"<think>{big}</think>4"},
            {"role": "user", "content": "and?"}]})
        assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
        assert len(engine.calls) == calls

        def broken(conv):
            raise KeyError("secret internals")

        srv.gateway.check = broken
        err = error("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                    500)
        assert err["code"] == "internal_error" and err["type"] == "server_error"
        assert "KeyError" in err["message"] and "secret" not in err["message"]
        del srv.gateway.check
        r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
        assert len(clients) == 1  # every answer, the 500 included, kept the connection
