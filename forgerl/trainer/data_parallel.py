"""Data-parallel training over torch.distributed: gloo on CPU, NCCL on CUDA.

Every worker holds a full replica of the policy and its AdamW state, equal at start (the same
checkpoint or seed). One step, on every worker with the same groups:

1. `Trainer.prepare` builds the same batch everywhere (advantages, samples, prefix tree and the
   global loss-token count N are deterministic functions of the groups);
2. `balance_rows` gives each worker a share of the tree rows with about equal tokens, and the
   worker runs forward + backward on its rows only. Each row's loss is already divided by the
   global N (CASES.md C07), so the per-worker gradients are partial sums of the one-worker
   gradient;
3. one `all_reduce(SUM)` over a flat fp32 buffer of all gradients (plus the loss statistics)
   gives every worker the full gradient, equal to the one-worker step's up to float summation
   order; clipping and the optimizer step then run identically, so the replicas stay equal.

This is what DDP's gradient all-reduce does, without DDP's requirement that every worker runs
the same number of forwards (a step's rows need not divide evenly).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from forgerl.trainer.trainer import PreparedBatch, Trainer
from forgerl.types import Group

if TYPE_CHECKING:
    from forgerl.config import Config


def balance_rows(row_tokens: list[int], workers: int) -> list[list[int]]:
    """Row indices per worker, longest row first to the least-loaded worker (LPT greedy): the
    largest share is at most 4/3 of the optimum. Each share is in ascending row order; a worker
    may get none. Raises ValueError for workers < 1."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    load, shares = [0] * workers, [[] for _ in range(workers)]
    for i in sorted(range(len(row_tokens)), key=lambda i: (-row_tokens[i], i)):
        w = min(range(workers), key=lambda w: (load[w], w))
        load[w] += row_tokens[i]
        shares[w].append(i)
    return [sorted(s) for s in shares]


class DataParallelTrainer(Trainer):
    """A `Trainer` that is one worker of a torch.distributed process group (initialised by the
    caller, e.g. `dist.init_process_group("gloo", ...)`). Same arguments as `Trainer`; every
    worker must call `train_step` with the same groups (rank and world size: the default
    group's). Metrics are the global ones (loss, ratio statistics summed or maxed over
    workers), plus `rows_per_worker_max`. On rank 0, `workers` (set by the controller) hands
    each step's groups to the other ranks first."""

    workers: TrainerWorkers | None = None

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """`Trainer.train_step` on every rank at once (rank 0 sends the groups); raises
        RuntimeError naming a worker's error when a worker failed or died."""
        if self.workers is None:  # ranks 1..: driven by rank 0
            return super().train_step(groups)
        self.workers.send(groups)
        try:
            metrics = super().train_step(groups)
        except RuntimeError as e:  # e.g. gloo: a peer closed its connection
            self.workers.collect(e)
            raise
        self.workers.collect(None)
        return metrics

    def accumulate_gradients(self, batch: PreparedBatch) -> dict[str, float]:
        """Forward + backward of this worker's rows, then the all-reduced gradient sum: one
        flat fp32 buffer of shape (Σ numel of the parameters + 3,) (the gradients, then the
        loss, Σ ratio and Σ clipped over this worker's loss tokens), summed over workers, and
        ratio_max reduced with MAX. Each parameter's .grad becomes its slice of that buffer."""
        shares = balance_rows([r.input_ids.numel() for r in batch.tree.rows],
                              dist.get_world_size())
        mine = [batch.tree.rows[i] for i in shares[dist.get_rank()]]
        local = super().accumulate_gradients(replace(batch, tree=replace(batch.tree, rows=mine)))
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        n = max(batch.num_loss_tokens, 1)  # the base class divides sums by the global N
        stats = torch.tensor([local["loss"], local["ratio_mean"] * n, local["clip_frac"] * n],
                             device=self.device)
        flat = torch.cat([*(g.reshape(-1).float() for g in grads), stats])
        dist.all_reduce(flat)
        ratio_max = torch.tensor([local["ratio_max"]])
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()
        loss, ratio_sum, clipped = flat[offset:].tolist()
        return {"loss": loss, "ratio_mean": ratio_sum / n, "ratio_max": ratio_max.item(),
                "clip_frac": clipped / n, "rows_per_worker_max": float(max(map(len, shares)))}


class TrainerWorkers:
    """Ranks 1..N-1 of a data-parallel trainer: spawned processes, each building the policy and
    a `DataParallelTrainer` from the same config (and the run's latest checkpoint, so replicas
    start equal), then running `train_step` on each step's groups from a pipe. This process
    joins as rank 0 (`dist.init_process_group` over gloo, rendezvous file in `run_dir`).

    A worker that raises reports its error and exits; one killed outright closes its gloo
    connections. Either way rank 0's next collective fails within `timeout_s` at most and the
    step raises RuntimeError naming the worker: the run stops after its last checkpoint.
    `timeout_s`: seconds any collective (and the rendezvous) may wait for a peer.
    """

    def __init__(self, config: Config, run_dir: Path, timeout_s: float = 300.0) -> None:
        world = config.trainer.workers
        rendezvous = run_dir / ".dist_rendezvous"
        rendezvous.unlink(missing_ok=True)
        init = f"file://{rendezvous.resolve()}"
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, daemon=True, name=f"forgerl-trainer-{rank}",
                               args=(rank, init, config.model_dump(), str(run_dir), timeout_s,
                                     child))
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def send(self, groups: list[Group]) -> None:
        """Hand one step's groups to every worker (RuntimeError when one has gone)."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            try:
                conn.send(groups)
            except (BrokenPipeError, ConnectionResetError, OSError):
                proc.join(1)
                self.collect(RuntimeError(
                    f"trainer worker {rank} has exited (exit code {proc.exitcode})"))

    def collect(self, cause: BaseException | None) -> None:
        """Wait for every worker's step result; raise RuntimeError naming the first failed
        worker (or `cause`'s message when a worker died without a word). Returns when all
        workers finished the step and `cause` is None."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            try:
                error = conn.recv() if cause is None or conn.poll(5.0) else None
            except (EOFError, OSError):
                error = f"exited with code {proc.exitcode}" if cause is None else None
            if error is not None:
                raise RuntimeError(f"trainer worker {rank}: {error}") from cause
        if cause is not None:
            raise RuntimeError(f"data-parallel trainer step failed: {cause}") from cause

    def close(self) -> None:
        """Stop the workers and leave the process group."""
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_main(rank: int, init: str, config_dump: dict, run_dir: str, timeout_s: float,
                 conn: Connection) -> None:
    """Body of worker `rank`: replica from the config (and checkpoint), then one train_step per
    groups message until None; an error is sent to rank 0 and ends the worker."""
    from forgerl.config import Config
    from forgerl.controller import build_trainer, load_policy
    from forgerl.trainer.checkpoint import latest_checkpoint, load_checkpoint

    config = Config.model_validate(config_dump)
    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=config.trainer.workers,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(config.seed)
    trainer = build_trainer(config, load_policy(config.model.path)[0])
    if (ckpt := latest_checkpoint(run_dir)) is not None:
        trainer.step = load_checkpoint(ckpt, trainer.model, trainer.optimizer)[0]
    while (groups := conn.recv()) is not None:
        try:
            trainer.train_step(groups)
        except Exception as e:
            conn.send(f"{type(e).__name__}: {e}")
            raise SystemExit(1) from None
        conn.send(None)
    dist.destroy_process_group()
