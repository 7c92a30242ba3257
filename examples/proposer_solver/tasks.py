"""Task file of the proposer-solver example: each task is a seed for the proposer.

A ForgeRL task file (`[tasks] dataset = "tasks.py"`). A task asks the proposer for one
addition problem that uses a given number; `score` reads the episode's answer (agent.py prints
it as JSON) and gives each policy its own reward (docs/multi-policy.md):

    solver:   the fraction of its attempts at the proposed problem that are right (0, 0.5, 1
              with two attempts); no reward when the proposal did not parse (it was not called)
    proposer: 0 for no "A + B" with at most `max_digits` digits per number; else 0.5,
              plus 0.5 when the problem is solvable but not trivial: some attempt right, some
              wrong
"""

from __future__ import annotations

import json
import random
import re


def make_tasks(size: int, seed: int, max_digits: int = 2) -> list[dict]:
    """`size` tasks {"question", "answer": "", "metadata": {"number", "max_digits"}}; the
    question names a number to use (so questions differ) and an example of the format."""
    if not 1 <= max_digits <= 6:
        raise ValueError(f"max_digits must be in 1..6, got {max_digits}")
    rng = random.Random(seed)
    tasks = []
    for _ in range(size):
        n, a, b = (rng.randint(1, 10 ** max_digits - 1) for _ in range(3))
        tasks.append({"question": f"Write one addition problem that uses the number {n}. "
                                  f"Reply with only the problem, like {a} + {b}",
                      "answer": "", "metadata": {"number": n, "max_digits": max_digits}})
    return tasks


def parse_problem(text: str) -> tuple[int, int] | None:
    """The first "A + B" in `text` (numbers of at most 6 digits), else None."""
    match = re.search(r"(\d{1,6})\s*\+\s*(\d{1,6})", text)
    return None if match is None else (int(match[1]), int(match[2]))


def right(attempt: str, a: int, b: int) -> bool:
    """Whether the last integer of `attempt` is a + b."""
    numbers = re.findall(r"-?\d+", attempt)
    return bool(numbers) and int(numbers[-1]) == a + b


def score(task: dict, answer: str) -> dict[str, float]:
    """Each policy's reward for one episode (module docstring); `answer` is agent.py's JSON
    {"problem": [a, b] or null, "attempts": [text, ...]}."""
    episode = json.loads(answer)
    if episode.get("problem") is None:
        return {"proposer": 0.0}
    a, b = episode["problem"]
    solved = [right(t, a, b) for t in episode["attempts"]]
    rate = sum(solved) / len(solved)
    in_range = max(a, b) < 10 ** task["metadata"]["max_digits"]
    return {"solver": rate, "proposer": in_range * (0.5 + 0.5 * (0.0 < rate < 1.0))}
