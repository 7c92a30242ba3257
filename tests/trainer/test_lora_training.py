"""LoRA as a plain option of `forgerl train` ([model] lora, forgerl/trainer/lora.py).

Pins: config validation (rank, targets, unsupported combinations: one line naming the field);
a LoRA trainer's AdamW holds only the adapter; a step changes the adapter and leaves every base
weight bitwise unchanged; the engine given the merged weights samples with logprobs equal to
the trainer's adapter forward (ratio 1 within 1e-5; a dense and a MoE policy) and reuses no
prefix-cache KV of the weights before the sync; the packed prefix-tree loss and adapter
gradients equal a plain forward per sample; activation checkpointing's recompute runs with the
adapter even when the backward runs on another thread (as CUDA's autograd does); the
checkpointed adapter is peft's format and loads back (optimizer state included) and into peft.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from forgerl.config import ConfigError, LoraConfig, load_config
from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model, build_tiny_moe
from forgerl.trainer.checkpoint import load_checkpoint, save_checkpoint
from forgerl.trainer.lora import PolicyAdapter, check_targets
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.trainer import Trainer
from forgerl.trainer.tree_forward import forward_logprobs
from forgerl.types import Completion, Group, SamplingParams, Trajectory
from tests.trainer.test_trainer import make_groups, naive_loss

PROMPT = [2, 16, 1, 60, 61, 62, 63, 2, 16, 1]


@pytest.mark.parametrize(("overrides", "expected"), [
    (["--model.lora", "{rank = 0}"], "model.lora.rank: Input should be greater than or equal"),
    (["--model.lora", "{targets = []}"], "model.lora.targets: List should have at least 1"),
    (["--model.lora", "{rnak = 4}"], "model.lora.rnak: Extra inputs are not permitted"),
    (["--model.lora", "{rank = 4}", "--engine.speculative_tokens", "2"],
     "model.lora is not supported with engine.speculative_tokens > 0"),
    (["--model.lora", "{rank = 4}", "--trainer.workers", "2"],
     "model.lora is not supported with trainer.workers = 2"),
    (["--model.lora", "{rank = 4}", "--engine.type", "remote"],
     "model.lora is not supported with engine.type = 'remote'"),
])
def test_bad_lora_config_is_one_line_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_default_is_full_fine_tuning_and_targets_must_name_linears():
    assert load_config(None, []).model.lora is None
    lora = load_config(None, ["--model.lora", "{rank = 8, alpha = 16}"]).model.lora
    assert (lora.rank, lora.alpha, lora.targets) == (8, 16.0, ["q_proj", "k_proj", "v_proj",
                                                                "o_proj"])
    model = build_tiny_model()
    check_targets(model, ["q_proj", "down_proj"])  # both exist
    with pytest.raises(ConfigError, match=r"^model.lora.targets: 'qkv' names no Linear layer of "
                       r"this model \(its Linear layers: down_proj, gate_proj, k_proj"):
        check_targets(model, ["q_proj", "qkv"])
    with pytest.raises(ConfigError, match=r"^model\.lora\.targets: 'lm_head' is the output head"):
        check_targets(model, ["lm_head"])


def _lora_trainer(rank: int = 4, checkpointing: str = "off", build=build_tiny_model,
                  **kwargs) -> Trainer:
    trainer = Trainer(build(), lr=1e-2, device="cpu",
                      activation_checkpointing=checkpointing, **kwargs)
    trainer.attach_lora(PolicyAdapter.wrap(trainer.model, LoraConfig(rank=rank), 0, "tiny"))
    return trainer


async def _sample(engine: LocalEngine, n: int = 4) -> list[Trajectory]:
    """n rollouts of PROMPT, one after another (each may reuse the prompt's cached KV)."""
    outs = [await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12,
                                                         seed=s)) for s in range(n)]
    return [Trajectory(f"r{i}", 0, i, [Completion(PROMPT, o.completion_ids, o.logprobs,
                                                  o.weight_versions, 0, o.finish_reason)],
                       reward=float(i % 2), status="finished") for i, o in enumerate(outs)]


def _ratio_errors(trainer: Trainer, group: Group) -> torch.Tensor:
    """|policy / behavior - 1| of every loss token of `group` (no optimizer step)."""
    batch = trainer.prepare([group])
    errors = []
    with torch.no_grad(), trainer._adapter():
        for row in batch.tree.rows:
            flat = batch.offsets[row.sample_idx] + row.token_idx
            lp = forward_logprobs(trainer.model, row)
            errors.append((lp - batch.behavior_logprobs[flat]).exp().sub(1).abs())
    return torch.cat(errors)


@pytest.mark.parametrize("build", [build_tiny_model, build_tiny_moe])
def test_a_step_trains_the_adapter_only_and_the_merged_sync_is_on_policy(build):
    """Also for a MoE policy (tiny Mixtral: LoRA on its attention, the experts untouched)."""
    trainer = _lora_trainer(build=build)
    adapter = trainer.lora
    params = adapter.parameters()
    assert [p for g in trainer.optimizer.param_groups for p in g["params"]] == params
    assert not any(p.requires_grad for p in trainer.model.parameters())
    base = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    async def run() -> None:
        engine = LocalEngine(trainer.model, max_model_len=256, max_batch_size=4)
        try:
            first = Group(0, await _sample(engine))
            assert engine.stats["prefix_hits"] == 3  # the prompt's KV is reused
            assert _ratio_errors(trainer, first).max() < 1e-5
            metrics = trainer.train_step([first])
            assert metrics["num_loss_tokens"] > 0 and abs(metrics["ratio_mean"] - 1) < 1e-5
            synced = trainer.state_dict_for_sync()
            assert len(synced) == 8 and all(k.endswith(("q_proj.weight", "k_proj.weight",
                                                        "v_proj.weight", "o_proj.weight"))
                                            for k in synced)
            await engine.update_weights(synced, trainer.step)
            hits = engine.stats["prefix_hits"]
            second = Group(1, await _sample(engine))  # the same prompt, new weights: its
            assert engine.stats["prefix_hits"] == hits + 3  # first prefill reuses no old KV
            assert second.trajectories[0].completions[0].weight_versions[0] == 1
            errors = _ratio_errors(trainer, second)
            assert errors.max() < 1e-5
            state = engine.model.state_dict()
            for name, value in synced.items():
                assert torch.equal(state[name], value)
                assert not torch.equal(state[name], base[name])  # the adapter moved it
        finally:
            await engine.close()

    asyncio.run(run())
    assert trainer.step == 1
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, base[name]), name  # the base is bitwise unchanged
    assert all(p.abs().sum() > 0 for p in params)  # B (zero at init) moved too
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(params) == 16  # 2 layers x 4 targets x (A, B): nothing else


def _row(n: int = 24):
    ids = [PROMPT + list(range(70, 70 + n)), PROMPT + list(range(90, 90 + n))]
    needed = [[t >= len(PROMPT) for t in range(len(s))] for s in ids]
    return build_tree_batch(ids, 256, needed=needed).rows[0]


def _randomize(trainer: Trainer) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize(("merge", "max_row_tokens", "checkpointing"),
                         [(True, 4096, "off"), (False, 4096, "off"), (True, 24, "full")])
def test_packed_lora_loss_and_adapter_grads_equal_naive_per_sample(merge, max_row_tokens,
                                                                   checkpointing):
    """The prefix-tree rows (merged or not, split over rows, recomputed) through the hooked
    Linears give the loss and adapter gradients of one plain causal forward per sample."""
    model = build_tiny_model()
    groups = make_groups(model, shift=(0.0, -0.6, 0.4, 0.1))
    trainer = Trainer(model, device="cpu", failed_reward=None, merge_prefixes=merge,
                      max_row_tokens=max_row_tokens, activation_checkpointing=checkpointing)
    trainer.attach_lora(PolicyAdapter.wrap(model, LoraConfig(rank=4), 0))
    _randomize(trainer)
    batch = trainer.prepare(groups)
    metrics = trainer.accumulate_gradients(batch)
    packed = [p.grad.clone() for p in trainer.lora.parameters()]
    trainer.optimizer.zero_grad(set_to_none=True)
    with trainer.lora.active():
        ref, _ = naive_loss(model, groups)
        ref.backward()
    assert metrics["loss"] == pytest.approx(ref.item(), abs=1e-5) and abs(ref.item()) > 1e-3
    for ours, theirs in zip(packed, (p.grad for p in trainer.lora.parameters()), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    assert all(p.grad is None for p in model.parameters())  # the base gets no gradient


def test_checkpointed_recompute_uses_the_adapter_on_another_thread():
    """CUDA's autograd runs the backward (and so the recompute) on its own thread, where the
    trainer thread's active adapter is not set; the recompute's context enters it there."""
    grads = []
    for checkpointing, thread in (("off", False), ("full", True)):
        trainer = _lora_trainer(checkpointing=checkpointing)
        _randomize(trainer)
        with trainer._adapter():
            loss = forward_logprobs(trainer.model, _row()).sum()
        if thread:
            worker = threading.Thread(target=loss.backward)
            worker.start()
            worker.join()
        else:
            loss.backward()
        grads.append([p.grad.clone() for p in trainer.lora.parameters()])
    for off, full in zip(*grads, strict=True):
        torch.testing.assert_close(full, off, rtol=1e-5, atol=1e-7)


def test_checkpoint_saves_the_adapter_in_peft_format_and_resumes_it(tmp_path):
    trainer = _lora_trainer(rank=8)
    _randomize(trainer)
    trainer.lora.parameters()[0].grad = None
    for p in trainer.lora.parameters():
        p.grad = torch.ones_like(p)
    trainer.optimizer.step()
    ckpt = save_checkpoint(tmp_path, trainer.model, trainer.optimizer, 3, {"k": 1},
                           states=trainer.checkpoint_state(), adapter=trainer.lora)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.json"]
    fresh = _lora_trainer(rank=8)
    assert load_checkpoint(ckpt, fresh.model, fresh.optimizer, fresh.lora) == (3, {"k": 1})
    for a, b in zip(trainer.lora.parameters(), fresh.lora.parameters(), strict=True):
        assert torch.equal(a, b)
    saved, loaded = trainer.optimizer.state_dict(), fresh.optimizer.state_dict()
    for i, s in saved["state"].items():
        assert torch.equal(s["exp_avg"], loaded["state"][i]["exp_avg"])
    other = _lora_trainer(rank=4)
    with pytest.raises(ValueError, match=r"has rank 8, alpha 32\.0"):
        load_checkpoint(ckpt, other.model, other.optimizer, other.lora)
    peft = pytest.importorskip("peft", reason="peft (the dev extra) loads the saved adapter")
    reference = peft.PeftModel.from_pretrained(build_tiny_model(), ckpt).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad(), trainer._adapter():
        ours = trainer.model.eval()(ids).logits
    torch.testing.assert_close(reference(ids).logits, ours, rtol=1e-5, atol=1e-5)


def test_delta_sync_carries_the_adapted_linears_only():
    """`[trainer] weight_sync = "delta"` on a LoRA run: after the first (full) sync, deltas of
    the merged q/k/v/o weights alone, applied exactly."""
    from forgerl.trainer.weight_sync import WeightSync

    trainer = _lora_trainer()

    async def run() -> None:
        engine = LocalEngine(trainer.model, max_model_len=256, max_batch_size=4)
        try:
            sync = WeightSync(engine, "delta")
            assert (await sync.sync(trainer.state_dict_for_sync(), 0))["kind"] == "full"
            trainer.train_step([Group(0, await _sample(engine))])
            stats = await sync.sync(trainer.state_dict_for_sync(), trainer.step)
            merged = trainer.lora.merged()
            assert stats["kind"] == "delta" and stats["changed_fraction"] > 0.5
            assert stats["bytes"] <= sum(v.numel() * 4 for v in merged.values()) == 98304
            state = engine.model.state_dict()
            assert all(torch.equal(state[k], v) for k, v in merged.items())
        finally:
            await engine.close()

    asyncio.run(run())


def test_resume_refuses_a_checkpoint_of_the_other_kind(tmp_path):
    """A LoRA checkpoint resumed without [model] lora (or another rank), and a full one with it,
    stop with one line naming model.lora."""
    from forgerl.controller.rundir import resume

    lora = _lora_trainer(rank=8)
    save_checkpoint(tmp_path / "lora", lora.model, lora.optimizer, 1, {},
                    states=lora.checkpoint_state(), adapter=lora.lora)
    full = Trainer(build_tiny_model(), device="cpu")
    save_checkpoint(tmp_path / "full", full.model, full.optimizer, 1, {})
    for run_dir, trainer, expected in [
            ("lora", full, "holds a LoRA adapter"), ("full", _lora_trainer(), "holds all weights"),
            ("lora", _lora_trainer(rank=4), "has rank 8, alpha 32.0")]:
        with pytest.raises(ConfigError) as info:
            resume(tmp_path / run_dir, trainer, "tiny")
        assert str(info.value).startswith("model.lora: ") and expected in str(info.value)
        assert "\n" not in str(info.value)
    assert resume(tmp_path / "lora", _lora_trainer(rank=8), "tiny") is None  # no scheduler state
