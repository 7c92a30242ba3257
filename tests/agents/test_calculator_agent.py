"""The calculator_agent example, run as a black box against real OpenAI-compatible servers.

Semantics pinned: the agent (plain `openai` client, no ForgeRL import) sends its system prompt,
`--shots` worked examples as real earlier turns (user question, assistant tool call, tool
result, assistant answer) and then the task; it executes the model's calculator calls with the
safe evaluator, stops when the model answers without tool calls and prints the last number of
that answer; when FORGERL_MAX_TURNS calls end in tool calls it prints an empty answer. Through
the ForgeRL gateway the example turns are rendered in its Hermes format (`<tool_call>` blocks
and `<tool_response>` turns), which is what makes them a usable demonstration for the model.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from forgerl.agents.runner import run_command_agent
from forgerl.config import load_config
from forgerl.controller import start_services
from tests.agents.test_chain_sum_agent import chat_response, scripted_server  # noqa: F401

AGENT = Path(__file__).resolve().parents[2] / "examples" / "calculator_agent" / "agent.py"
QUESTION = "State the final answer to the following arithmetic problem: 1663 - 5242 + 9376 ="
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator",
                 "arguments": json.dumps({"expression": "1663 - 5242 + 9376"})},
}


def load_agent():
    import importlib.util

    spec = importlib.util.spec_from_file_location("calculator_agent", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent = load_agent()


def run(base_url: str, *args: str, env: dict[str, str] | None = None):
    command = [sys.executable, str(AGENT), *args]
    return asyncio.run(run_command_agent(command, {"question": QUESTION}, base_url,
                                         "sk-session-1", 30.0, env=env or {}))


def test_few_shot_turns_then_tool_call_then_answer(scripted_server):  # noqa: F811
    base_url, script, requests = scripted_server
    script += [chat_response("", [CALL]), chat_response("5797")]
    result = run(base_url)
    assert (result.status, result.answer) == ("finished", "5797"), result.stderr_tail
    first, second = requests
    messages = first["messages"]
    assert messages[0] == {"role": "system", "content": agent.SYSTEM_PROMPT}
    assert messages[-1] == {"role": "user", "content": QUESTION}
    shots = messages[1:-1]  # default --shots 2: 4 messages per example
    assert [m["role"] for m in shots] == ["user", "assistant", "tool", "assistant"] * 2
    assert shots[0]["content"] == f"{agent.PREFIX}4821 + 3907 ="
    call = shots[1]["tool_calls"][0]
    assert (call["id"], json.loads(call["function"]["arguments"])) == (
        "call_ex0", {"expression": "4821 + 3907"})
    assert shots[2] == {"role": "tool", "tool_call_id": "call_ex0", "content": "8728"}
    assert shots[3] == {"role": "assistant", "content": "8728"}
    assert first["tools"] == [agent.CALCULATOR] and first["max_tokens"] == 64
    assert second["messages"][-2] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "5797"}


def test_turn_limit_and_shot_count(scripted_server):  # noqa: F811
    base_url, script, requests = scripted_server
    script += [chat_response("", [CALL]) for _ in range(2)]
    result = run(base_url, "--shots", "0", env={"FORGERL_MAX_TURNS": "2"})
    assert (result.status, result.answer) == ("finished", None)  # no final reply: no answer
    assert len(requests) == 2 and len(requests[0]["messages"]) == 2
    bad = run(base_url, "--shots", "9")
    assert bad.status == "failed" and "usage" in bad.stderr_tail


def test_calculator_tool():
    assert agent.run_tool("calculator", json.dumps({"expression": "1663 - 5242 + 9376"})) == "5797"
    assert agent.run_tool("calculator", json.dumps({"expression": "7 / 2 ="})) == "3.5"
    assert agent.run_tool("calculator", json.dumps({"expression": "__import__('os')"})).startswith(
        "error")
    assert agent.run_tool("search", "{}").startswith("error: unknown tool")
    for expression, result in agent.SHOTS:  # the worked examples are right
        assert agent.run_tool("calculator", json.dumps({"expression": expression})) == result


def test_example_turns_render_as_hermes_through_the_gateway(tmp_path):
    """The agent against the real gateway (tiny model): its first recorded prompt holds the
    example turns as Hermes tool calls and tool responses."""
    config = load_config(Path(__file__).resolve().parents[2] / "examples" / "calculator_agent"
                         / "config.toml",
                         ["--run_dir", str(tmp_path / "run"), "--model.path", "tiny",
                          "--model.max_model_len", "2048", "--rollout.max_tokens", "8",
                          "--tasks.eval_size", "0", "--tasks.size", "4",
                          "--agent.command", json.dumps(["python", str(AGENT), "--shots", "3"])])

    async def one_rollout() -> str:
        async with start_services(config) as s:
            reward = await s.rollout(-1, 0, s.tasks[0], temperature=1.0)
            [traj] = s.pool.get_group(-1).trajectories
            assert traj.status == "finished", traj.error
            assert 0.0 <= reward <= 1.0
            return s.gateway.renderer.decode(traj.completions[0].prompt_ids)

    prompt = asyncio.run(one_rollout())
    for i, (expression, result) in enumerate(agent.SHOTS):
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        assert f"user\n{agent.PREFIX}{expression} =\n" in prompt, i
        assert f"assistant\n<tool_call>\n{call}\n</tool_call>\n" in prompt, i
        assert f"user\n<tool_response>\n{result}\n</tool_response>\n" in prompt, i
        assert f"assistant\n{result}\n" in prompt, i
    assert '"name": "calculator"' in prompt.split("<tools>\n")[1].split("\n</tools>")[0]
    assert prompt.endswith("assistant\n")


@pytest.mark.parametrize("argv", [[], ["--shots", "1"]])
def test_parse_shots(argv):
    assert agent.parse_shots(argv) == (2 if not argv else 1)
