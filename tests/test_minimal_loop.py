"""examples/minimal_loop.py on the tiny random model for 2 steps, with real parts throughout.

Pins: every completion the gateway recorded in the SQLite pool is exactly what the engine
sampled (prompt ids, completion ids, logprobs, by sampling seed); each step's weight sync moves
the engine to weight_version 1, then 2, and the next rollouts are stamped with it; the synced
weights differ from the initial ones and from each other; losses are finite; one printed line
per step.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import torch

from forgerl.datapool.sqlite import SQLitePool
from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("minimal_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_minimal_loop_two_steps(tmp_path, monkeypatch, capsys):
    sampled, synced = {}, []
    generate, update_weights = LocalEngine.generate, LocalEngine.update_weights

    async def recording_generate(self, prompt_ids, params):
        out = await generate(self, prompt_ids, params)
        sampled[params.seed] = (list(prompt_ids), out)
        return out

    async def recording_update(self, state_dict, version):
        synced.append((version, {k: v.detach().clone() for k, v in state_dict.items()}))
        await update_weights(self, state_dict, version)

    monkeypatch.setattr(LocalEngine, "generate", recording_generate)
    monkeypatch.setattr(LocalEngine, "update_weights", recording_update)
    history = asyncio.run(load_example().main("tiny", steps=2, group_size=4, run_dir=tmp_path))

    assert [h["step"] for h in history] == [1, 2]
    assert [h["weight_version"] for h in history] == [1, 2]
    assert all(math.isfinite(h["loss"]) and h["loss"] != 0.0 for h in history)
    assert all(0.0 <= h["reward_mean"] <= 1.0 and 0.0 <= h["held_out_reward"] <= 1.0
               for h in history)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["step 1", "step 2"]
    assert "weight_version 2" in lines[1]

    pool = SQLitePool(tmp_path / "pool.sqlite")
    try:
        groups = {i: pool.get_group(i) for i in (0, 1, -1, -2)}
    finally:
        pool.close()
    assert [len(groups[i].trajectories) for i in (0, 1, -1, -2)] == [4, 4, 1, 1]
    behavior = {0: 0, 1: 1, -1: 1, -2: 2}  # the weight_version each group was sampled with
    records = 0
    for i, group in groups.items():
        for trajectory in group.trajectories:
            assert trajectory.status == "finished" and trajectory.reward is not None
            [c] = trajectory.completions
            prompt_ids, out = sampled[c.sampling.seed]
            assert c.prompt_ids == prompt_ids
            assert c.completion_ids == out.completion_ids and c.logprobs == out.logprobs
            assert 1 <= len(c.completion_ids) <= 32
            assert c.weight_versions == [behavior[i]] * len(c.completion_ids)
            records += 1
    assert records == len(sampled) == 10
    rewards = [t.reward for t in groups[0].trajectories]
    assert max(rewards) > min(rewards)  # the shaped reward gives the group a spread

    assert [version for version, _ in synced] == [1, 2]
    initial = build_tiny_model().state_dict()  # the example's model: same seed, same weights
    first, second = synced[0][1], synced[1][1]
    assert first.keys() == initial.keys()
    assert any(not torch.equal(first[k], initial[k]) for k in initial)
    assert any(not torch.equal(second[k], first[k]) for k in first)
