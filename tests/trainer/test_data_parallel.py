"""Data-parallel trainer: 2 real worker processes over gloo against the 1-process trainer.

Pins (issue 13): with the rows of one step split across 2 workers, the all-reduced gradient
equals the 1-worker gradient within 1e-5 (fp32) and so do the weights after two optimizer
steps, and the loss and ratio statistics are the global ones (the loss keeps its global
loss-token normalisation, CASES.md C07); `balance_rows` is a partition of the rows whose
largest share is at most the mean share plus one row. With `sharding = "fsdp"` (FSDP2 over
gloo) the same holds for the gathered gradients and weights, each worker holding half of every
sharded parameter, and a checkpoint taken from the sharded trainer (gathered in full) resumes
into a 1-process trainer that then steps like the uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from forgerl.models import build_tiny_model
from forgerl.trainer.data_parallel import DataParallelTrainer, balance_rows
from forgerl.trainer.trainer import Trainer
from tests.trainer.test_trainer import make_groups

ROW_TOKENS = 24  # small rows, so one step has several rows to split


def _setup(trainer_cls):
    torch.manual_seed(0)
    model = build_tiny_model()
    groups = make_groups(model, shift=(0.3, -0.2, 0.1))  # ratios away from 1
    trainer = trainer_cls(model, device="cpu", failed_reward=None, max_row_tokens=ROW_TOKENS,
                          lr=1e-2)
    return trainer, groups


def _run(trainer, groups):
    """(gradient of step 1 by name, step-1 metrics, weights after 2 steps)."""
    batch = trainer.prepare(groups)
    stats = trainer.accumulate_gradients(batch)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    metrics = trainer.train_step(groups) | stats
    trainer.train_step(groups)
    return grads, metrics, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank: int, world: int, init: str, out: str, sharding: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        trainer, groups = _setup(DataParallelTrainer)
        trainer.sharding = sharding
        if sharding == "fsdp":
            trainer._shard()
            local = {n: p.to_local().numel() for n, p in trainer.model.named_parameters()}
        batch = trainer.prepare(groups)
        stats = trainer.accumulate_gradients(batch)
        grads = {n: _full(p.grad).clone() for n, p in trainer.model.named_parameters()}
        trainer.optimizer.zero_grad(set_to_none=True)
        metrics = trainer.train_step(groups) | stats
        trainer.train_step(groups)
        weights = {n: _full(p).detach().clone() for n, p in trainer.model.named_parameters()}
        result = {"grads": grads, "metrics": metrics, "weights": weights}
        if sharding == "fsdp":
            result |= {"local": local, "sync": trainer.state_dict_for_sync() if rank == 0 else {},
                       "ckpt": trainer.checkpoint_state()}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_two_workers_equal_one_worker(tmp_path, sharding):
    grads, metrics, weights = _run(*_setup(Trainer))
    batch = _setup(Trainer)[0].prepare(_setup(Trainer)[1])
    assert len(batch.tree.rows) >= 3  # the step really is split
    out = str(tmp_path / "dp")
    mp.start_processes(_worker, args=(2, f"file://{tmp_path / 'rendezvous'}", out, sharding),
                       nprocs=2, start_method="spawn")
    results = [torch.load(f"{out}.{r}") for r in range(2)]
    for result in results:
        for name, g in grads.items():
            torch.testing.assert_close(result["grads"][name], g, rtol=0, atol=1e-5)
        for name, w in weights.items():
            torch.testing.assert_close(result["weights"][name], w, rtol=0, atol=1e-5)
        for key in ("loss", "ratio_mean", "ratio_max", "clip_frac", "num_loss_tokens",
                    "grad_norm"):
            assert result["metrics"][key] == pytest.approx(metrics[key], abs=1e-5), key
        assert result["metrics"]["rows_per_worker_max"] < len(batch.tree.rows)
    for name in weights:  # the replicas are identical, bit for bit
        assert torch.equal(results[0]["weights"][name], results[1]["weights"][name])
    if sharding == "fsdp":
        _check_sharded(results, weights)


def _check_sharded(results, weights):
    """Half of each parameter per worker; the synced weights and the gathered checkpoint are
    the full ones, and resuming from that checkpoint steps like the uninterrupted trainer."""
    for name, w in weights.items():
        assert results[0]["local"][name] + results[1]["local"][name] == w.numel()
        assert results[0]["local"][name] == -(-w.shape[0] // 2) * w[0].numel()
        torch.testing.assert_close(results[0]["sync"][name], w, rtol=0, atol=1e-5)
    model_state, optim_state = results[0]["ckpt"]
    reference, groups = _setup(Trainer)
    reference.train_step(groups)
    reference.train_step(groups)
    resumed, _ = _setup(Trainer)
    resumed.model.load_state_dict(model_state)
    resumed.optimizer.load_state_dict(optim_state)
    for trainer in (reference, resumed):
        trainer.train_step(groups)
    for (name, p), q in zip(reference.model.named_parameters(), resumed.model.parameters(),
                            strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=1e-5, msg=name)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4096), max_size=40), st.integers(1, 8))
def test_balance_rows_partitions_within_the_greedy_bound(tokens, workers):
    shares = balance_rows(tokens, workers)
    assert len(shares) == workers
    assert sorted(i for s in shares for i in s) == list(range(len(tokens)))
    loads = [sum(tokens[i] for i in s) for s in shares]
    # greedy list scheduling's guarantee: the mean load plus one row
    assert max(loads, default=0) <= sum(tokens) / workers + max(tokens, default=0)


def test_balance_rows_rejects_no_workers():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        balance_rows([1, 2], 0)
