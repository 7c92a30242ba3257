"""Shared test builders: Completion / Trajectory records and transformers' greedy reference.

Records are what the gateway writes to the pool and the trainer reads back; tests of samples,
advantages, rewards and the trainer build them by hand with `completion` and `trajectory`.
`hf_greedy` is the reference the engine tests compare an engine's greedy ids with. The fixtures
(`tokenizer`, `tiny_model`) live in tests/conftest.py; the gateway's test doubles and its
`renderer` fixture and `served` helper in tests/gateway/conftest.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch

from forgerl.types import Completion, Event, SamplingParams, Trajectory, TrajectoryStatus


def completion(
    prompt_ids: list[int],
    completion_ids: list[int],
    logprobs: list[float] | None = None,
    versions: list[int] | None = None,
    *,
    temperature: float = 1.0,
    token_exact: bool = True,
    started_at: float = 0.0,
) -> Completion:
    """A recorded call that finished with "stop".

    logprobs: per completion id (default -0.5 each). versions: weight version per completion
    id (default 0 each); the call's `weight_version` is the first one (0 for no ids).
    """
    n = len(completion_ids)
    logprobs = [-0.5] * n if logprobs is None else logprobs
    versions = [0] * n if versions is None else versions
    return Completion(
        prompt_ids,
        completion_ids,
        logprobs,
        versions,
        versions[0] if versions else 0,
        "stop",
        sampling=SamplingParams(temperature=temperature),
        started_at=started_at,
        token_exact=token_exact,
    )


def trajectory(
    tid: str,
    turns: list[Completion],
    reward: float | None,
    *,
    task: int = 0,
    rollout: int = 0,
    process: list[float] | None = None,
    status: TrajectoryStatus = "finished",
    events: Iterable[Event] = (),
    started_at: float = 0.0,
    ended_at: float = 0.0,
) -> Trajectory:
    """A recorded rollout: id `tid`, `turns` in order, outcome `reward`, per-turn `process`
    rewards (Trajectory.turn_rewards), task / rollout index, status and process events."""
    return Trajectory(
        tid,
        task,
        rollout,
        turns,
        reward=reward,
        turn_rewards=process,
        status=status,
        started_at=started_at,
        ended_at=ended_at,
        events=list(events),
    )


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The n argmax ids after `prompt` under a transformers causal LM, over its KV cache.

    No stop at EOS (engines stop on stop ids only). The cache argument is `cache` from
    transformers 5.24 on and `past_key_values` before (.venv-vllm has 5.19).
    """
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids, past, step = list(prompt), None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            out = model(step, **{name: past}, use_cache=True)
            past = getattr(out, name)
            ids.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[ids[-1]]])
    return ids[len(prompt) :]
