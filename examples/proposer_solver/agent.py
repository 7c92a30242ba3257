"""The proposer-solver agent: two trained policies in one episode, asked for by model name.

It imports nothing from ForgeRL. It reads the question from `FORGERL_TASK` (JSON), asks the
"proposer" model for an addition problem, and, when the reply holds one ("A + B"), asks the
"solver" model for its sum, two attempts in one call (`n = 2`). The last stdout line is the
episode as JSON ({"problem": [a, b] or null, "attempts": [...]}), which tasks.py scores with
one reward per policy. The gateway records each call under the model it names.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY (read by the openai client), FORGERL_MAX_TOKENS
(per call, default 24).
"""

from __future__ import annotations

import json
import os

from openai import OpenAI
from tasks import parse_problem  # this folder is the agent's working directory


def main() -> None:
    task = json.loads(os.environ["FORGERL_TASK"])
    client = OpenAI(max_retries=0)
    max_tokens = int(os.environ.get("FORGERL_MAX_TOKENS", "24"))
    proposal = client.chat.completions.create(
        model="proposer", max_tokens=max_tokens,
        messages=[{"role": "user", "content": task["question"]}]).choices[0].message.content
    problem = parse_problem(proposal or "")  # tasks.py checks its digits
    attempts: list[str] = []
    if problem is not None:
        reply = client.chat.completions.create(
            model="solver", max_tokens=max_tokens, n=2,
            messages=[{"role": "user", "content": f"What is {problem[0]} + {problem[1]}? "
                                                  "Reply with only the number."}])
        attempts = [c.message.content or "" for c in reply.choices]
    print(json.dumps({"problem": problem, "attempts": attempts}))


if __name__ == "__main__":
    main()
