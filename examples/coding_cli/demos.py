"""Demonstrations for the coding-CLI job's warm start: scripted correct Pi transcripts.

Each demonstration is a real Pi session on a training task, run by the job's own agent
(`agent.episode`: same working directory, Pi config and check) against a small scripted
Chat Completions server instead of the policy. The server answers Pi's first call with the
task's correct tool call (`solution`) and its second with "Done."; it keeps Pi's request
bodies, so the record is exactly what Pi sent on its last call (system prompt, task, the tool
call, Pi's own tool result; its tool declarations) plus the final reply, in the OpenAI
fine-tuning chat format that `[warmstart] demos` reads. A demonstration whose check fails is
an error.

    python examples/coding_cli/demos.py --count 40 --out examples/coding_cli/demos.jsonl

The tasks are the first `--count` training tasks of config.toml (held-out questions excluded).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import agent
import tasks

HERE = Path(__file__).resolve().parent


def solution(question: str) -> tuple[str, dict]:
    """The correct tool call for a task: (Pi tool name, arguments)."""
    kind, f = tasks.parse(question)
    if kind == "create":
        return "write", {"path": f["name"], "content": f["word"] + "\n"}
    if kind == "replace":
        return "edit", {"path": f["name"], "edits": [{"oldText": f["old"], "newText": f["new"]}]}
    if kind == "append":
        return "bash", {"command": f"echo {f['word']} >> {f['name']}"}
    return "bash", {"command": f"rm {f['name']}"}


class ScriptedChat(ThreadingHTTPServer):
    """POST /v1/chat/completions, keyed by the bearer key "demo-<i>" = `questions[i]`: the
    correct tool call when the request holds no assistant message yet, else "Done."
    (streamed when asked). `requests[i]` is the last request body of session i."""

    def __init__(self, questions: list[str]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.questions, self.requests = questions, {}
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedChat

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        index = int(self.headers.get("authorization", "").rsplit("-", 1)[-1])
        with self.server.lock:
            self.server.requests[index] = body
        if any(m.get("role") == "assistant" for m in body["messages"]):
            message, finish = {"role": "assistant", "content": "Done."}, "stop"
        else:
            name, args = solution(self.server.questions[index])
            call = {"index": 0, "id": f"call_demo{index}", "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish = "tool_calls"
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        common = {"id": "chatcmpl-demo", "created": 0, "model": body.get("model", "policy")}
        if body.get("stream"):
            chunks = [{**common, "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": message, "finish_reason": None}]},
                      {**common, "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                       "usage": usage}]
            data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self._send(data.encode(), "text/event-stream")
        else:
            choice = {"index": 0, "message": message, "finish_reason": finish}
            self._send(json.dumps({**common, "object": "chat.completion", "choices": [choice],
                                   "usage": usage}).encode(), "application/json")

    def _send(self, data: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def record(body: dict) -> dict:
    """A demonstration record from Pi's last request body: its messages plus "Done.", its
    tools (each assistant message trained)."""
    return {"messages": [*body["messages"], {"role": "assistant", "content": "Done."}],
            "tools": body.get("tools", [])}


def make_demos(questions: list[str], workers: int = 2) -> list[dict]:
    """One checked demonstration record per question, in order. Raises RuntimeError naming
    the task when Pi did not finish it (the check failed or Pi made fewer than two calls)."""
    server = ScriptedChat(questions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"

    def one(i: int) -> dict:
        passed = agent.episode(questions[i], base_url, f"demo-{i}", "policy", max_turns=3,
                               max_tokens=128, timeout_s=120)
        body = server.requests.get(i)
        if not passed or body is None or len(body["messages"]) < 3:
            raise RuntimeError(f"demonstration {i} failed: {questions[i]!r}")
        return record(body)

    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, range(len(questions))))
    finally:
        server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--out", type=Path, default=HERE / "demos.jsonl")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parents[1]))
    from forgerl.config import load_config  # lazy: only the task sets need ForgeRL
    from forgerl.controller import make_task_sets

    train, _ = make_task_sets(load_config(HERE / "config.toml"))
    questions = [t["question"] for t in train[: args.count]]
    demos = make_demos(questions, args.workers)
    args.out.write_text("".join(json.dumps(d) + "\n" for d in demos))
    print(f"{len(demos)} demonstrations -> {args.out}")


if __name__ == "__main__":
    main()
