"""`[trainer] workers = 2` in the controller: rank 0 in the controller process, rank 1 a spawned
process building its replica from the same config (and checkpoint), real rollouts.

Pins (issue 13): the controller's 2-worker steps on real recorded groups give the weights a
1-process trainer gets on the same groups (within 1e-5, fp32); a resumed run's worker starts
from the checkpoint (its steps still match); a worker killed with SIGKILL makes the next step
raise a RuntimeError naming the worker within seconds, never a hang. The same run with
`trainer.sharding = "fsdp"` (FSDP2 over gloo): the synced (gathered) weights match too, and the
checkpoint it writes is the full model and AdamW state, which both ranks resume from.
"""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch

from forgerl.controller import start_services
from forgerl.trainer.data_parallel import DataParallelTrainer, build_trainer
from tests.test_controller import make_agent, sync, tiny_config


def _config(run_dir, *extra):
    # small rows, so each step's prefix tree has rows for both workers
    return tiny_config(run_dir, "--trainer.workers", "2", "--trainer.max_row_tokens", "128",
                       "--model.max_model_len", "128", "--rollout.tasks_per_step", "4",
                       "--trainer.device", "cpu", "--tasks.eval_size", "0", *extra)


async def _step_against_reference(s, reference):
    s.admit()
    batch = await s.next_batch()
    groups = [s.pool.get_group(i) for i in batch]
    rows = len(reference.prepare(groups).tree.rows)
    want = reference.train_step(groups)
    got = await s.train(batch)
    assert got["num_loss_tokens"] == want["num_loss_tokens"] > 0
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert rows >= 2 and got["rows_per_worker_max"] < rows  # both workers had rows
    ref = reference.model.state_dict()
    for name, p in s.trainer.state_dict_for_sync().items():  # gathered under fsdp
        torch.testing.assert_close(p, ref[name].detach(), rtol=0, atol=1e-5)
    await s.sync_weights()


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
@sync
async def test_two_workers_train_like_one_and_resume(tmp_path, sharding):
    run_dir = tmp_path / "run"
    config = _config(run_dir, "--trainer.sharding", sharding)
    async with start_services(config, make_agent()) as s:
        assert isinstance(s.trainer, DataParallelTrainer)
        reference = build_trainer(_config(run_dir, "--trainer.workers", "1"),
                                  copy.deepcopy(s.trainer.model))
        for _ in range(2):
            await _step_against_reference(s, reference)
        await s.checkpoint()
    async with start_services(config, make_agent()) as s:  # both ranks resume from step 2
        assert s.trainer.step == 2
        await _step_against_reference(s, reference)


@sync
async def test_a_killed_worker_stops_the_step_with_a_clear_error(tmp_path):
    async with start_services(_config(tmp_path / "run"), make_agent()) as s:
        [proc] = s.trainer.workers.procs
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        s.admit()
        batch = await s.next_batch()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="trainer worker 1") as e:
            await s.train(batch)
        assert "exit code -9" in str(e.value)
        assert time.monotonic() - start < 30
