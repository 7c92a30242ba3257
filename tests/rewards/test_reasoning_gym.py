"""reasoning-gym task and reward pins.

Semantics pinned: tasks are deterministic in the seed, JSON-safe (what the data pool stores is
what gets scored), carry the dataset name, and are scored by reasoning-gym's own scorer on the
original entry: exact answers get 1.0, a missing answer 0.0, and reasoning-gym's partial credit
(e.g. a wrong sign) passes through unchanged. The reward also runs under the out-of-process
timeout wrapper.
"""

from __future__ import annotations

import json

import pytest

from forgerl.rewards.reasoning_gym import make_tasks, score
from forgerl.rewards.scoring import ScoreResult, score_with_timeout

PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_chain_sum_tasks_are_deterministic_and_json_safe():
    tasks = make_tasks("chain_sum", 4, 1, **PARAMS)
    assert tasks == make_tasks("chain_sum", 4, 1, **PARAMS)
    assert tasks != make_tasks("chain_sum", 4, 2, **PARAMS)
    assert json.loads(json.dumps(tasks)) == tasks
    first = tasks[0]
    assert set(first) == {"question", "answer", "metadata", "dataset"}
    assert first["dataset"] == "chain_sum"
    assert first["question"].endswith(f"{first['metadata']['expression']} =")
    for task in tasks:
        a, op, b = task["metadata"]["expression"].split()
        assert int(task["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_score_uses_reasoning_gyms_scorer():
    task = next(t for t in make_tasks("chain_sum", 20, 1, **PARAMS) if int(t["answer"]) > 0)
    right = task["answer"]
    assert score(task, right) == 1.0
    assert score(task, f" +0{right}.0 ") == 1.0  # reasoning-gym tolerates sign/zeros/decimals
    assert score(task, str(int(right) + 1)) == 0.0
    assert score(task, f"-{right}") == 0.5  # its partial credit for a wrong sign
    assert score(task, None) == 0.0


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "leg_counting"])
def test_other_datasets_score_their_own_answers(dataset):
    task = make_tasks(dataset, 1, 0)[0]
    assert task["dataset"] == dataset
    assert score(task, task["answer"]) == 1.0


def test_score_runs_under_the_timeout_wrapper():
    tasks = make_tasks("chain_sum", 3, 1, **PARAMS)
    items = [(tasks[0], tasks[0]["answer"]), (tasks[1], "nonsense"), (tasks[2], None)]
    results = score_with_timeout(score, items, timeout_s=10.0)
    assert results == [ScoreResult(1.0, "ok"), ScoreResult(0.0, "ok"), ScoreResult(0.0, "ok")]
