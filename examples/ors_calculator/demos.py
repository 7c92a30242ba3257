"""Worked episodes of the calculator environment for `[warmstart]`: the cold start the field
uses when the untrained policy never calls a tool, so RL has no success to reinforce.

Each demonstration is played against the running server through ForgeRL's own ORS adapter, so
its prompt and tools are exactly what a rollout sees: calculate(the sum) → the server's value →
submit(that value) → "correct". Held-out ("test") tasks are never used.

    python examples/ors_calculator/server.py --port 8080 &
    python examples/ors_calculator/demos.py --url http://127.0.0.1:8080 --out demos.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

from forgerl.tasks.ors import Adapter


async def play_call(episode, messages: list[dict], call_id: str, name: str, args: dict) -> str:
    """Append the assistant's call and the environment's answer to `messages`; the answer."""
    messages.append({"role": "assistant", "content": "", "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)}}]})
    step = await episode.call(name, args)
    messages.append({"role": "tool", "tool_call_id": call_id, "content": step.content})
    return step.content


async def demos(adapter: Adapter, tasks: list[dict]) -> list[dict]:
    await adapter.start()
    records = []
    try:
        for k, task in enumerate(tasks):
            episode = await adapter.open(task)
            expression = re.search(r"What is ([\d +]+)\?", task["question"]).group(1)
            messages = [dict(m) for m in episode.prompt]
            value = await play_call(episode, messages, f"call_{k}_0", "calculate",
                                    {"expression": expression})
            await play_call(episode, messages, f"call_{k}_1", "submit", {"answer": value})
            assert messages[-1]["content"] == "correct", messages[-1]
            del messages[-1]  # the episode ended with submit: no model call sees its result
            await episode.close()
            records.append({"messages": messages, "tools": episode.tools})
    finally:
        await adapter.stop()
    return records


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).with_name("demos.jsonl")))
    args = parser.parse_args()
    adapter = Adapter(args.url, {"environment": "calculator", "split": "train"}, Path.cwd())
    tasks = adapter.tasks("train", args.size, args.seed)  # its sync client: outside the loop
    records = asyncio.run(demos(adapter, tasks))
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} demonstrations in {args.out}")
