"""`forgerl train` with `[model] lora` on the tiny model: the RL loop (controller.run) with the
gateway over HTTP, the local engine, the SQLite pool and checkpoints.

Pins: every step is on-policy (ratio within 1e-5 of 1 at max_off_policy_steps = 0, so the engine
decodes with exactly the merged adapter), only the adapter trains (every base weight bitwise
unchanged), the weight sync carries the adapted Linears alone, the checkpoint holds the adapter
in peft's format, and a resume restores the adapter and its AdamW state and gives the engine the
merged weights before it samples; a target that names no Linear stops the start with one line
before the run directory is written.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from forgerl.config import ConfigError
from forgerl.controller import run, start_services
from forgerl.models import build_tiny_model
from tests.test_controller import make_agent, sync, tiny_config

pytestmark = pytest.mark.slow

LORA = ["--model.lora", "{rank = 4, alpha = 8}", "--scheduler.max_off_policy_steps", "0",
        "--tasks.eval_size", "0"]


@sync
async def test_train_with_lora_is_on_policy_trains_the_adapter_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    await run(tiny_config(run_dir, *LORA), agent=make_agent(), progress=False)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "ratio_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["num_loss_tokens"] > 0 and r["token_off_policy_lag_max"] == 0
        assert abs(r["ratio_mean"] - 1) < 1e-5 and abs(r["ratio_max"] - 1) < 1e-5, r
        assert r["weight_sync_kind"] == "full"
        assert r["weight_sync_bytes"] == 2 * (64 * 64 * 2 + 32 * 64 * 2) * 4  # q,o + k,v fp32
    ckpt = run_dir / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.json"]
    saved = safetensors.torch.load_file(ckpt / "adapter_model.safetensors")
    assert len(saved) == 16 and all(v.abs().sum() > 0 for v in saved.values())

    async with start_services(tiny_config(run_dir, *LORA, "--max_steps", "3"),
                              make_agent()) as s:
        assert s.trainer.step == 2 and s.engine.weight_version == 2
        for key, value in s.trainer.lora.lora.state_dict("policy").items():
            assert torch.equal(value, saved[key]), key
        assert len(s.trainer.optimizer.state_dict()["state"]) == 16  # the adapter's AdamW
        assert all(int(v["step"]) == 2 for v in s.trainer.optimizer.state_dict()["state"].values())
        base = build_tiny_model().state_dict()  # the run's base: [model] path "tiny", seed 0
        merged = s.trainer.lora.merged()
        engine = s.engine.model.state_dict()
        for name, value in s.trainer.model.state_dict().items():
            assert torch.equal(value, base[name]), name  # LoRA never touched the base
            assert torch.equal(engine[name], merged.get(name, value)), name
        assert sum(not torch.equal(merged[k], base[k]) for k in merged) == 8
        s.admit()
        metrics = await s.train(await s.next_batch())
        assert abs(metrics["ratio_max"] - 1) < 1e-5 and s.trainer.step == 3


@sync
async def test_a_lora_target_that_names_no_linear_stops_the_start(tmp_path):
    config = tiny_config(tmp_path / "run", "--model.lora", "{targets = ['q_proj', 'attn']}")
    with pytest.raises(ConfigError, match=r"^model.lora.targets: 'attn' names no Linear layer"):
        async with start_services(config, make_agent()):
            pass
    assert not (tmp_path / "run").exists()
