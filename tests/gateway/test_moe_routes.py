"""R3 end to end: the real app over HTTP with the local engine on the tiny MoE records each
turn's routed experts in the SQLite pool, and a training step replays them."""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_moe
from forgerl.trainer.routing_replay import routes_tensor
from forgerl.trainer.trainer import Trainer
from forgerl.types import Group
from tests.engines.test_moe_routes import reference_routes

from .test_local_engine import Recording


def test_routes_in_sqlite_are_the_engines_and_a_step_replays_them(serve, tokenizer):
    model = build_tiny_moe()
    engine = Recording(LocalEngine(model, max_model_len=1024, max_batch_size=4, device="cpu"))
    srv = serve(engine, tokenizer)
    tids = []
    try:
        for seed in range(2):
            tid, key = srv.session(task_index=0)
            tids.append(tid)
            client = srv.client(key)
            messages = [{"role": "user", "content": "Route me."}]
            for turn in range(2):
                r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                   temperature=1.0, seed=10 * seed + turn)
                messages += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Again."}]
        trajectories = [srv.pool.get_trajectory(t) for t in tids]
    finally:
        asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)
    records = [c for t in trajectories for c in t.completions]
    assert len(records) == 4 == len(engine.outputs)
    for rec, (prompt, out) in zip(records, engine.outputs, strict=True):
        stored = rec.routed_experts
        fed = rec.prompt_ids + rec.completion_ids
        assert len(stored) == min(len(fed), len(prompt) + len(out.completion_ids) - 1)
        assert stored == out.routed_experts.cut(len(fed))  # what the engine used, stored as is
        assert torch.equal(routes_tensor(stored), reference_routes(model, fed[:len(stored)]))
    group = Group(0, [dataclasses.replace(t, reward=float(i), status="finished")
                      for i, t in enumerate(trajectories)])
    trainer = Trainer(model, device="cpu", lr=1e-4)
    metrics = trainer.train_step([group])
    assert metrics["unrouted_turns"] == 0
    assert metrics["replayed_tokens"] >= metrics["tokens_after_merge"] - 2  # all but 2 leaves
    assert abs(metrics["ratio_max"] - 1) < 1e-4  # same weights, same routes
