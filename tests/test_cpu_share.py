"""CpuShare: the local engine's decode thread and the trainer split the CPU's threads while both
are busy, and a part that runs alone gets all of them (forgerl/cpu_share.py, issue 14).

Pins: the thread counts for 1, 2, 4 and 16 cores, and that the two parts' largest teams never
outnumber the cores plus the main thread (libgomp's throttled wait, cpu_share.py); that
`torch.set_num_threads` in one thread leaves another thread's count alone (what the split relies
on) and that `enter` holds against another thread changing the process-wide count; that the
engine's worker runs its decode steps at fewer threads only while the trainer is busy and gets
them back after, and its prefills always at its count beside the trainer; that the trainer's
rows run at its share, and the step's loss is unchanged; and that the controller wires one
share into the trainer and the engine of a CPU run, its main thread left at one thread.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from forgerl.controller import start_services
from forgerl.cpu_share import CpuShare, single_threaded_caller
from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model
from forgerl.trainer.losses import cispo_loss
from tests.test_controller import make_agent, tiny_config
from tests.trainer.test_trainer import _trainer, make_groups


def test_threads_split_only_while_both_parts_are_busy():
    before = torch.get_num_threads()
    share = CpuShare(cores=16)
    assert (share.threads("engine"), share.threads("trainer"), share.threads("prefill")) == (
        9, 8, 8)
    share.enter("trainer")
    assert (share.threads("engine"), share.threads("trainer")) == (8, 8)
    share.enter("engine")
    assert (share.threads("engine"), share.threads("trainer")) == (8, 8)
    share.leave("trainer")
    assert share.threads("engine") == 9
    two, one = CpuShare(cores=2), CpuShare(cores=1)
    assert (two.threads("engine"), two.threads("trainer"), two.threads("prefill")) == (2, 1, 1)
    two.enter("trainer")
    one.enter("trainer")
    assert (two.threads("engine"), one.threads("engine")) == (1, 1)
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 7, 16, 64])
def test_the_largest_teams_fit_the_cores(cores):
    share = CpuShare(cores=cores)
    engine_alone, trainer = share.threads("engine"), share.threads("trainer")
    share.enter("trainer")
    engine_beside = share.threads("engine")
    # workers of both pools (team - 1 each) plus the main thread <= cores: libgomp keeps spinning
    assert (engine_alone - 1) + (trainer - 1) + 1 <= cores
    assert engine_beside + trainer <= max(2, cores)  # both busy: no more threads than cores
    assert engine_alone >= (cores + 1) // 2 and engine_beside >= 1 and trainer >= 1
    torch.set_num_threads(1)


def test_enter_holds_when_another_thread_changes_the_global_count():
    """torch sets a thread's count from the process-wide one at its first parallel op; a count
    set by `enter` before that op must survive another thread's set_num_threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    share, entered, changed, seen = CpuShare(cores=2), threading.Event(), threading.Event(), []

    def trainer():
        share.enter("trainer")
        entered.set()
        changed.wait()
        (torch.ones(1 << 20) * 2).sum()  # a parallel op after the other thread's change
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=trainer)
    thread.start()
    entered.wait()
    torch.set_num_threads(2)  # as the engine's thread does when it runs alone
    changed.set()
    thread.join()
    torch.set_num_threads(before)
    assert seen == [1]


def test_single_threaded_caller_returns_the_count_it_had():
    torch.set_num_threads(2)
    assert single_threaded_caller() == 2 and torch.get_num_threads() == 1


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
    prefills: list[int] = []
    decode, prefill = engine._decode, engine._prefill_wave

    def counting(batch):  # runs in the engine's worker thread
        counts.append(torch.get_num_threads())
        return decode(batch)

    def counting_prefill(rows):
        prefills.append(torch.get_num_threads())
        return prefill(rows)

    engine._decode, engine._prefill_wave = counting, counting_prefill

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
    assert prefills == [1, 1]  # a prefill never takes all of the cores, trainer busy or not


def test_trainer_rows_run_at_its_share_whether_or_not_the_engine_decodes():
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
    assert counts == [2] * 2 * n and n >= 1  # half of 4 cores, the engine busy or not
    assert shared["loss"] == pytest.approx(reference["loss"], rel=1e-6)  # same numbers
    assert alone["num_loss_tokens"] == shared["num_loss_tokens"]


def test_a_cpu_run_shares_the_cpu_between_its_trainer_and_engine(tmp_path):
    async def main():
        async with start_services(tiny_config(tmp_path / "a"), make_agent()) as s:
            return s.trainer.cpu_share, s.engine.cpu_share, torch.get_num_threads()

    torch.set_num_threads(2)
    trainer_share, engine_share, main_threads = asyncio.run(main())
    torch.set_num_threads(1)
    assert isinstance(trainer_share, CpuShare) and trainer_share is engine_share
    assert trainer_share.cores == 2 and main_threads == 1  # the main thread runs no team
