"""Task file for the parallel-tools job: two independent 3-4-digit sums or differences per task.

A ForgeRL task file (`[tasks] dataset = "tasks.py"`): `make_tasks` builds the tasks offline,
deterministic in `seed`; `score` is the verifier (1.0 when the answer's last two numbers are the
two results, in either order; else 0.0).
"""

from __future__ import annotations

import random
import re


def make_tasks(size: int, seed: int, min_digits: int = 3, max_digits: int = 4) -> list[dict]:
    """`size` tasks {"question", "answer", "metadata": {"results": [x, y]}}, e.g. "Compute
    4821 + 3907 and 9034 - 7658." with answer "8728, 1376". Raises ValueError on bad digits."""
    if not 1 <= min_digits <= max_digits <= 9:
        raise ValueError(f"need 1 <= min_digits <= max_digits <= 9, got {min_digits}, {max_digits}")
    rng = random.Random(seed)

    def term() -> int:
        return rng.randint(10 ** (rng.randint(min_digits, max_digits) - 1), 10 ** max_digits - 1)

    tasks = []
    for _ in range(size):
        parts, results = [], []
        for _ in range(2):
            a, b, op = term(), term(), rng.choice("+-")
            parts.append(f"{a} {op} {b}")
            results.append(a + b if op == "+" else a - b)
        tasks.append({"question": f"Compute {parts[0]} and {parts[1]}.",
                      "answer": f"{results[0]}, {results[1]}",
                      "metadata": {"results": results}})
    return tasks


def score(task: dict, answer: str) -> float:
    """1.0 when the last two numbers of `answer` are the task's two results (either order)."""
    numbers = [int(n) for n in re.findall(r"-?\d+", answer.replace(",", " "))][-2:]
    return 1.0 if sorted(numbers) == sorted(task["metadata"]["results"]) else 0.0
