"""A small shell agent for Harbor tasks: asks the model for one shell command per turn and runs it
in the current directory (the task's workdir, inside the rollout's sandbox).

It imports nothing from ForgeRL (stdlib only). One episode: read the task (FORGERL_TASK JSON,
its "question"), then up to FORGERL_MAX_TURNS times: POST the conversation to
OPENAI_BASE_URL/chat/completions, take the command (the first ```sh block, else the first
line of the answer; "DONE" or an empty answer ends the episode), run it with `sh -c` (20 s),
send back its exit code and output. The last answer is printed on stdout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request

SYSTEM = ("You are in a Linux shell. Answer with exactly one shell command that does the task "
          "and nothing else. Answer DONE when the task is done.")


def ask(messages: list[dict]) -> str:
    body = {"model": os.environ.get("OPENAI_MODEL", "policy"), "messages": messages,
            "max_tokens": int(os.environ.get("FORGERL_MAX_TOKENS", "64"))}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["message"]["content"] or ""


def command_of(answer: str) -> str:
    block = re.search(r"```(?:sh|bash)?\n(.*?)```", answer, re.S)
    text = block[1] if block else answer
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def main() -> None:
    question = json.loads(os.environ["FORGERL_TASK"])["question"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    answer = ""
    for _ in range(int(os.environ.get("FORGERL_MAX_TURNS", "1"))):
        answer = ask(messages)
        messages.append({"role": "assistant", "content": answer})
        command = command_of(answer)
        if not command or command.upper() == "DONE":
            break
        try:
            done = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                                  timeout=20)
            result = f"exit {done.returncode}\n{(done.stdout + done.stderr)[-2000:]}"
        except subprocess.TimeoutExpired:
            result = "timed out after 20 s"
        messages.append({"role": "user", "content": result})
    print(answer)


if __name__ == "__main__":
    main()
