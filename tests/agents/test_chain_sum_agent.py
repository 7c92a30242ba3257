"""The chain_sum example agent, run as a black box against a real OpenAI-compatible HTTP server.

Semantics pinned: the agent (plain `openai` client, no ForgeRL import) sends the task question
with the calculator tool, executes the model's tool call with the safe evaluator, sends the
assistant tool-call message and the tool result back, stops when the model answers without tool
calls, and prints the last number of that answer as its last stdout line; it stops at
FORGERL_MAX_TURNS. The evaluator accepts only numbers, + - * / and parentheses. The server here
is a scripted FastAPI app over uvicorn on 127.0.0.1 (not the ForgeRL gateway).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request

from forgerl.agents.runner import run_command_agent

AGENT = Path(__file__).resolve().parents[2] / "examples" / "chain_sum" / "agent.py"
TASK = {"question": "State the final answer to the following arithmetic problem: 17 - 9 + 4 ="}


def load_agent_module():
    spec = importlib.util.spec_from_file_location("chain_sum_agent", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent = load_agent_module()


def chat_response(content: str | None, tool_calls: list[dict] | None = None) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": tool_calls},
                "finish_reason": "tool_calls" if tool_calls else "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": json.dumps({"expression": "17 - 9 + 4"})},
}


@pytest.fixture
def scripted_server():
    """A real HTTP server replying from a script; yields (base_url, script, requests)."""
    app, script, requests = FastAPI(), [], []

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> dict:
        requests.append(await request.json())
        return script.pop(0)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1", script, requests
    server.should_exit = True
    thread.join(5)


def run(base_url: str, env: dict[str, str] | None = None):
    command = [sys.executable, str(AGENT)]
    return asyncio.run(
        run_command_agent(command, TASK, base_url, "sk-session-1", 30.0, env=env or {})
    )


def test_tool_call_then_answer(scripted_server):
    base_url, script, requests = scripted_server
    script += [chat_response("", [CALL]), chat_response("The result is 12.")]
    result = run(base_url, {"OPENAI_MODEL": "my-policy"})
    assert (result.status, result.answer) == ("finished", "12"), result.stderr_tail
    assert len(requests) == 2
    first, second = requests
    assert first["model"] == "my-policy"
    assert first["messages"] == [
        {"role": "system", "content": agent.SYSTEM_PROMPT},
        {"role": "user", "content": TASK["question"]},
    ]
    assert first["tools"] == [agent.CALCULATOR] and first["max_tokens"] == 128
    assert second["messages"][2] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert second["messages"][3] == {"role": "tool", "tool_call_id": "call_1", "content": "12"}
    assert "tool" in result.stderr_tail


def test_turn_limit_stops_a_looping_model(scripted_server):
    base_url, script, requests = scripted_server
    script += [chat_response("Let me compute 5", [CALL]) for _ in range(3)]
    result = run(base_url, {"FORGERL_MAX_TURNS": "2"})
    assert len(requests) == 2
    assert (result.status, result.answer) == ("finished", "5")


def test_unreachable_server_is_a_failed_rollout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    result = run(f"http://127.0.0.1:{port}/v1")
    assert result.status == "failed" and result.answer is None
    assert "APIConnectionError" in result.stderr_tail


@pytest.mark.parametrize(
    ("expression", "value"),
    [("17 - 9 + 4", 12), ("2 * (3 + 4)", 14), ("-3 + 10 / 4", -0.5), ("((1))", 1)],
)
def test_safe_eval_arithmetic(expression, value):
    assert agent.safe_eval(expression) == value


@pytest.mark.parametrize(
    "expression", ["__import__('os')", "2 ** 10", "abs(-1)", "x + 1", "1 +", "'a' * 3"]
)
def test_safe_eval_refuses_everything_else(expression):
    with pytest.raises(ValueError):
        agent.safe_eval(expression)


def test_run_tool_and_extract_answer():
    assert agent.run_tool("calculator", '{"expression": "7 / 2"}') == "3.5"
    assert agent.run_tool("calculator", '{"expression": "8 / 2"}') == "4"
    assert agent.run_tool("calculator", '{"expression": "1 / 0"}') == "error: division by zero"
    assert agent.run_tool("search", "{}") == "error: unknown tool 'search'"
    assert agent.extract_answer("so 4 - 9 = -5.") == "-5"
    assert agent.extract_answer("total: 1,250") == "1250"
    assert agent.extract_answer("no idea\nreally") == "no idea really"
