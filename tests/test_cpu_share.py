"""CpuShare: the local engine's decode thread and the trainer split the CPU's threads while both
are busy, and a part that runs alone gets all of them (forgerl/cpu_share.py, issue 14).

Pins: the thread counts for 1, 2 and 16 cores; that `torch.set_num_threads` in one thread leaves
another thread's count alone (what the split relies on); that the engine's worker runs its
steps at half the threads only while the trainer is busy and gets all back after; that the
trainer's rows run at half while the engine is busy, and the step's loss is unchanged; and that
the controller wires one share into the trainer and the engine of a CPU run.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from forgerl.controller import start_services
from forgerl.cpu_share import CpuShare
from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model
from forgerl.trainer.losses import cispo_loss
from tests.test_controller import make_agent, tiny_config
from tests.trainer.test_trainer import _trainer, make_groups


def test_threads_split_only_while_both_parts_are_busy():
    share = CpuShare(cores=16)
    assert share.threads("engine") == 16
    share.enter("trainer")
    assert (share.threads("engine"), share.threads("trainer")) == (8, 16)
    share.enter("engine")
    assert (share.threads("engine"), share.threads("trainer")) == (8, 8)
    share.leave("trainer")
    assert share.threads("engine") == 16
    two, one = CpuShare(cores=2), CpuShare(cores=1)
    two.enter("trainer")
    one.enter("trainer")
    assert (two.threads("engine"), one.threads("engine")) == (1, 1)


def test_set_num_threads_is_per_thread():
    seen = []
    before = torch.get_num_threads()

    def worker():
        torch.set_num_threads(3)
        seen.append(torch.get_num_threads())

    torch.set_num_threads(2)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [3] and torch.get_num_threads() == 2  # the caller's own count is kept
    torch.set_num_threads(before)


def test_engine_steps_at_half_the_threads_while_the_trainer_trains():
    share = CpuShare(cores=2)
    engine = LocalEngine(build_tiny_model(), max_model_len=64, cpu_share=share)
    counts: list[int] = []
    decode = engine._decode

    def counting(batch):  # runs in the engine's worker thread
        counts.append(torch.get_num_threads())
        return decode(batch)

    engine._decode = counting

    async def main():
        from forgerl.types import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=6)
        with share.busy("trainer"):
            busy = await engine.generate([1, 5, 6], params)
        alone = await engine.generate([1, 5, 7], params)
        await engine.close()
        return busy, alone

    busy, alone = asyncio.run(main())
    assert len(busy.completion_ids) == len(alone.completion_ids) == 6
    assert counts[:5] == [1] * 5  # the 5 decode steps after the prefill's first token
    assert counts[5:] and set(counts[5:]) == {2}  # alone again: all of the cores
    assert engine.stats["cpu_shared_steps"] == 6  # the prefill step and the 5 decode steps


def test_trainer_rows_run_at_half_the_threads_while_the_engine_decodes():
    model = build_tiny_model()
    groups = make_groups(model)
    reference = _trainer(build_tiny_model(), lr=1e-3).train_step(make_groups(build_tiny_model()))
    counts: list[int] = []

    def loss_fn(*args):  # called in the row loop, after the trainer's `enter`
        counts.append(torch.get_num_threads())
        return cispo_loss(*args)

    trainer = _trainer(model, lr=1e-3, loss_fn=loss_fn)
    trainer.cpu_share = share = CpuShare(cores=4)
    share.enter("engine")
    shared = trainer.train_step(groups)
    share.leave("engine")
    alone = trainer.train_step(make_groups(model))
    torch.set_num_threads(1)  # the suite's setting (tests/conftest.py)
    n = len(counts) // 2
    assert counts == [2] * n + [4] * n and n >= 1
    assert shared["loss"] == pytest.approx(reference["loss"], rel=1e-6)  # same numbers
    assert alone["num_loss_tokens"] == shared["num_loss_tokens"]


def test_a_cpu_run_shares_the_cpu_between_its_trainer_and_engine(tmp_path):
    async def main():
        async with start_services(tiny_config(tmp_path / "a"), make_agent()) as s:
            return s.trainer.cpu_share, s.engine.cpu_share

    trainer_share, engine_share = asyncio.run(main())
    assert isinstance(trainer_share, CpuShare) and trainer_share is engine_share
