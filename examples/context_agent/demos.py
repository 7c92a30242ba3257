"""Forget-mode demonstrations for the [warmstart] phase (`forgerl.controller.warmstart`).

SmolLM2-135M never calls `forget_tool_outputs` from the prompt alone (README: 0 of 85 sampled
round-2 decisions), so RL has no success to reinforce. This script runs the real agent
(`agent.make_agent("forget")`) against a scripted teacher instead of the gateway: the teacher
calls the calculator for each round's expression, replies with the result, calls
`forget_tool_outputs` before each later round's calculation and answers with both results.
Every model call the agent makes is recorded with the exact messages and tools it sent, and the
calls become records in the OpenAI fine-tuning chat format: consecutive calls whose messages
extend the previous call's messages + reply form one record; the forget call rewrites the
history, so each session gives two records (the second holds the first one's replies at
`"weight": 0`, as context). The worked sessions in the head are context too.

    python examples/context_agent/demos.py --out runs/forget_demos.jsonl --n 32
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

from openai.types.chat import ChatCompletion

sys.path.insert(0, str(Path(__file__).parent))

from agent import FINAL, make_agent


class Teacher:
    """Stands in for `openai.AsyncOpenAI` (`make_agent(..., client=Teacher)`): the scripted
    forget-mode policy. `chat.completions.create` calls the calculator for the round's
    expression, replies with a report's result, calls `forget_tool_outputs` when a later round
    starts and answers the final question with the results so far; every call's (messages,
    tools, reply) is appended to `calls`."""

    def __init__(self, **_: Any) -> None:
        self.calls: list[tuple[list[dict], list[dict], dict]] = []
        self.results: list[str] = []
        self.chat = self.completions = self

    async def __aenter__(self) -> Teacher:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    def reply(self, messages: list[dict]) -> tuple[str, list[tuple[str, dict]]]:
        """(content, tool calls as (name, arguments)) of the next assistant message."""
        last = messages[-1]
        if last["role"] == "tool" and last["content"].startswith("calculator report"):
            self.results.append(last["content"].rsplit("result: ", 1)[1])
            return self.results[-1], []
        if last["role"] == "user" and last["content"] == FINAL:
            return ", ".join(self.results), []
        if last["role"] == "user" and self.results:  # a later round: drop the old report first
            return "", [("forget_tool_outputs", {})]
        ask = [m["content"] for m in messages if m["role"] == "user"][-1]
        return "", [("calculator", {"expression": re.fullmatch(r"Compute (.+)\.", ask)[1]})]

    async def create(self, *, model: str, messages: list[dict], tools: list[dict],
                     **_: Any) -> ChatCompletion:
        content, wanted = self.reply(messages)
        calls = [{"id": f"call_{len(self.calls)}_{i}", "type": "function",
                  "function": {"name": name, "arguments": json.dumps(args)}}
                 for i, (name, args) in enumerate(wanted)]
        message = {"role": "assistant", "content": content,
                   **({"tool_calls": calls} if calls else {})}
        self.calls.append((copy.deepcopy(messages), copy.deepcopy(tools), message))
        return ChatCompletion.model_validate({
            "id": "demo", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop",
                         "message": {**message, "content": content or None}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})


def records(calls: list[tuple[list[dict], list[dict], dict]]) -> list[dict]:
    """Recorded calls → fine-tuning records (module docstring): the replies of the calls in a
    record are trained, every other assistant message has weight 0."""
    out, run = [], []
    for call in calls:
        if run and call[0][: len(run[-1][0]) + 1] != [*run[-1][0], run[-1][2]]:
            out.append(run)
            run = []
        run.append(call)
    out.append(run)
    result = []
    for run in out:
        messages, tools, reply = run[-1]
        trained = {len(m) for m, _, _ in run}
        messages = [*messages, reply]
        result.append({"tools": tools, "messages": [
            {**m, "weight": int(i in trained)} if m["role"] == "assistant" else m
            for i, m in enumerate(messages)]})
    return result


async def session_records(task: dict) -> list[dict]:
    """The records of one teacher-driven forget-mode session on `task`. Raises
    AssertionError when the agent's answer is not the task's `answer` (the teacher or agent
    broke)."""
    teachers: list[Teacher] = []

    def client(**kwargs: Any) -> Teacher:
        teachers.append(Teacher(**kwargs))
        return teachers[-1]

    answer = await make_agent("forget", client=client)(task, "http://teacher", "demo")
    assert answer == task["answer"], (answer, task["answer"])
    return records(teachers[0].calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--n", type=int, default=32, help="sessions (two records each)")
    parser.add_argument("--config", default=str(Path(__file__).with_name("config.toml")))
    args, overrides = parser.parse_known_args()
    from forgerl.config import load_config
    from forgerl.controller import make_task_sets

    tasks, _ = make_task_sets(load_config(args.config, overrides))
    lines = [json.dumps(r) for t in tasks[-args.n:] for r in asyncio.run(session_records(t))]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"demos.py: {len(lines)} records of {args.n} sessions -> {args.out}")


if __name__ == "__main__":
    main()
