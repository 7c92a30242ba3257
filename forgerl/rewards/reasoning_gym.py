"""Tasks and outcome rewards from `reasoning_gym` (procedurally generated, offline) or from a
user's Python file.

A task is a JSON-safe dict `{"question", "answer", "metadata", "dataset"}`: the dataset entry
exactly as reasoning-gym produced it (after a JSON round trip, so what the data pool stores and
gives back is what the scorer saw in tests) plus the dataset name. `score` hands reasoning-gym's
own `score_answer` the entry it expects (question, answer, metadata) and returns its reward in
[0, 1]. Run `score` under `forgerl.rewards.scoring.score_with_timeout` to guard against slow
verifiers.

A `dataset` that ends in ".py" is a user task file (the config loader makes its path absolute,
relative to the config file) that defines `make_tasks(size: int, seed: int, **params) ->
list[dict]` (each dict JSON-safe with at least "question" and "answer") and `score(task: dict,
answer: str) -> float` (or a dict: each policy's reward, `[[policies]]` name → float, for an
episode of several trained agents); its tasks carry the file's path as `dataset`, so resume
finds the same verifier.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Callable
from types import ModuleType

from forgerl.rewards.scoring import as_reward


def make_tasks(dataset: str, size: int, seed: int, **params: object) -> list[dict]:
    """`size` tasks of the reasoning-gym `dataset` with config `params`, deterministic in `seed`.

    Example: `make_tasks("chain_sum", 64, 0, min_terms=2, max_terms=2, max_digits=1)`.

    Raises:
        ValueError: unknown dataset or invalid params (reasoning-gym's own message), or a task
            file that is missing or lacks make_tasks / score.
    """
    if dataset.endswith(".py"):
        entries = [{"metadata": {}, **e}
                   for e in _user_file(dataset).make_tasks(size=size, seed=seed, **params)]
    else:
        import reasoning_gym  # lazy: a heavy import, only where tasks are made or scored

        entries = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **params)
    # JSON round trip: tuples in metadata become lists, as they will after storage.
    return [{**json.loads(json.dumps(e)), "dataset": dataset} for e in entries]


@functools.cache
def _user_file(path: str) -> ModuleType:
    """The user task file at `path`, imported once. Raises ValueError when it cannot be read
    or lacks make_tasks / score."""
    spec = importlib.util.spec_from_file_location(f"forgerl_tasks_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import task file {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise ValueError(f"task file not found: {path}") from None
    missing = [f for f in ("make_tasks", "score") if not callable(getattr(module, f, None))]
    if missing:
        raise ValueError(f"task file {path} does not define {', '.join(missing)}")
    return module


@functools.cache
def _scorer(dataset: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym  # lazy: optional extra (examples), 1-3.5 s to import

    return reasoning_gym.get_score_answer_fn(dataset)


def score(task: dict, answer: str | None) -> float | dict[str, float]:
    """reasoning-gym's reward for `answer` on `task` (1.0 = correct; some datasets give partial
    credit); 0.0 for a missing answer. A user task file may give one reward per policy.

    The scorer receives the original entry (`question`, `answer`, `metadata`), never the extra
    `dataset` key; a composite task is scored by its `metadata.source_dataset`.
    """
    if answer is None:
        return 0.0
    if task["dataset"].endswith(".py"):
        return as_reward(_user_file(task["dataset"]).score(task, answer))
    name = task["metadata"].get("source_dataset") or task["dataset"]
    entry = {"question": task["question"], "answer": task["answer"], "metadata": task["metadata"]}
    return float(_scorer(name)(answer, entry))
