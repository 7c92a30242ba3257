"""The parallel_tools example: its task file, its verifier and its agent as a black box.

Semantics pinned: the task file makes deterministic two-part tasks whose answer the verifier
accepts in either order and nothing else; the agent runs the tool calls of one reply
concurrently (two 0.5 s calls in one reply take about one latency, one call per reply takes two
plus a model call), sends the results back in call order, and prints the final reply on one
line. The completion time the trainer compares is the agent's whole wall-clock episode.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from forgerl.agents.runner import run_command_agent
from forgerl.rewards.reasoning_gym import make_tasks, score
from tests.agents.test_chain_sum_agent import chat_response, scripted_server  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "parallel_tools"
QUESTION = "Compute 1234 + 5678 and 4321 - 876."


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"parallel_tools_{name}", EXAMPLE / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent = load("agent.py")


def call(i: int, expression: str) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}


def run(base_url: str):
    command = [sys.executable, str(EXAMPLE / "agent.py")]
    return asyncio.run(run_command_agent(command, {"question": QUESTION}, base_url,
                                         "sk-session-1", 30.0,
                                         env={"FORGERL_TOOL_LATENCY_S": "0"}))


def solve_seconds(base_url: str, monkeypatch) -> tuple[str, float]:
    """The agent's episode in this process with a 1 s tool latency: (answer, seconds)."""
    from openai import OpenAI

    monkeypatch.setenv("FORGERL_TOOL_LATENCY_S", "1.0")
    start = time.monotonic()
    answer = agent.solve(OpenAI(base_url=base_url, api_key="sk-session-1"), QUESTION,
                         "policy", max_turns=4, max_tokens=96)
    return answer, time.monotonic() - start


def test_task_file_tasks_and_verifier():
    path = str(EXAMPLE / "tasks.py")
    tasks = make_tasks(path, 5, 3, min_digits=3, max_digits=4)
    assert tasks == make_tasks(path, 5, 3, min_digits=3, max_digits=4)
    assert tasks != make_tasks(path, 5, 4, min_digits=3, max_digits=4)
    for task in tasks:
        x, y = task["metadata"]["results"]
        assert task["dataset"] == path and task["answer"] == f"{x}, {y}"
        a, op1, b, _, c, op2, d = task["question"].removeprefix("Compute ").rstrip(".").split()
        assert x == (int(a) + int(b) if op1 == "+" else int(a) - int(b))
        assert y == (int(c) + int(d) if op2 == "+" else int(c) - int(d))
        assert score(task, f"{x}, {y}") == 1.0 and score(task, f"so: {y} and {x}") == 1.0
        assert score(task, f"{x}") == 0.0 and score(task, f"{x}, {y + 1}") == 0.0
        assert score(task, None) == 0.0


def test_calls_in_one_reply_run_concurrently(scripted_server, monkeypatch):  # noqa: F811
    base_url, script, requests = scripted_server
    script += [chat_response("", [call(1, "1234 + 5678"), call(2, "4321 - 876")]),
               chat_response("6912, 3445")]
    answer, seconds = solve_seconds(base_url, monkeypatch)
    assert answer == "6912, 3445"
    assert requests[1]["messages"][-2:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "6912"},
        {"role": "tool", "tool_call_id": "call_2", "content": "3445"}]
    assert requests[0]["messages"][1:-1] == agent.few_shot_messages()
    assert 1.0 <= seconds < 1.8  # one tool latency for both calls, not two


def test_one_call_per_reply_pays_each_latency(scripted_server, monkeypatch):  # noqa: F811
    base_url, script, requests = scripted_server
    script += [chat_response("", [call(1, "1234 + 5678")]),
               chat_response("", [call(2, "4321 - 876")]), chat_response("6912,\n3445")]
    answer, seconds = solve_seconds(base_url, monkeypatch)
    assert answer == "6912, 3445" and len(requests) == 3 and seconds >= 2.0


def test_agent_process_prints_the_final_reply_on_one_line(scripted_server):  # noqa: F811
    base_url, script, requests = scripted_server
    script += [chat_response("", [call(1, "1234 + 5678"), call(2, "4321 - 876")]),
               chat_response("6912,\n 3445")]
    result = run(base_url)
    assert (result.status, result.answer) == ("finished", "6912, 3445"), result.stderr_tail
    assert requests[0]["messages"][-1] == {"role": "user", "content": QUESTION}


def test_few_shot_history_shows_both_styles():
    messages = agent.few_shot_messages()
    replies = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    assert [len(m["tool_calls"]) for m in replies] == [2, 1, 1, 2]
    results = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    for m in replies:
        for c in m["tool_calls"]:
            expression = json.loads(c["function"]["arguments"])["expression"]
            assert results[c["id"]] == str(eval(expression))  # the shown results are right
    assert agent.run_tool("calculator", "{bad").startswith("error")
    assert agent.run_tool("search", "{}") == "error: unknown tool 'search'"


def test_styles_choose_how_each_shot_calls_its_tools():
    for styles, counts in [("sps", [1, 1, 2, 1, 1]), ("ppp", [2, 2, 2]), ("sss", [1] * 6)]:
        replies = [m for m in agent.few_shot_messages(styles)
                   if m["role"] == "assistant" and m.get("tool_calls")]
        assert [len(m["tool_calls"]) for m in replies] == counts
    assert agent.parse_args([]) == ("psp", "ccc")
    assert agent.parse_args(["--styles", "ssp"]) == ("ssp", "ccc")
    assert agent.parse_args(["--tools", "rcr", "--styles", "ppp"]) == ("ppp", "rcr")
    for bad in (["--styles", "sp"], ["--styles", "spx"], ["--shots", "psp"], ["--styles"],
                ["--tools", "ccx"]):
        with pytest.raises(ValueError, match="usage"):
            agent.parse_args(bad)


def test_remote_calculator_gives_the_same_answers_slower(monkeypatch):
    monkeypatch.setenv("FORGERL_TOOL_LATENCY_S", "0")
    monkeypatch.setenv("FORGERL_REMOTE_LATENCY_S", "0.3")
    args = json.dumps({"expression": "652 - 1479"})
    start = time.monotonic()
    assert agent.run_tool("calculator", args) == "-827"
    fast = time.monotonic() - start
    assert agent.run_tool("calculator_remote", args) == "-827"
    assert fast < 0.1 and time.monotonic() - start - fast >= 0.3
    names = [c["function"]["name"] for m in agent.few_shot_messages("ppp", "rcr")
             if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert names == ["calculator_remote"] * 2 + ["calculator"] * 2 + ["calculator_remote"] * 2


def test_remote_tool_is_declared_only_when_an_example_uses_it(scripted_server):  # noqa: F811
    from openai import OpenAI

    base_url, script, requests = scripted_server
    script += [chat_response("6912, 3445"), chat_response("6912, 3445")]
    for tools in ("ccc", "rcr"):
        agent.solve(OpenAI(base_url=base_url, api_key="sk-session-1"), QUESTION, "policy",
                    max_turns=4, max_tokens=96, styles="ppp", tools=tools)
    assert [[t["function"]["name"] for t in r["tools"]] for r in requests] == [
        ["calculator"], ["calculator", "calculator_remote"]]
