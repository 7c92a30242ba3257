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

`sharding = "fsdp"` (`trainer.sharding`) shards instead of replicating: FSDP2 (`fully_shard` on
every decoder layer and at the root, before the first step) keeps 1/N of the parameters,
gradients and AdamW state per worker; the backward reduce-scatters the gradient sums (divide
factor 1: row losses are already divided by the global N), a worker with fewer rows runs
zero-advantage copies of a row so that every worker runs as many forwards (FSDP's all-gathers
are collective), and after each step the full weights are gathered for weight sync.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from forgerl.config import Config
from forgerl.models import load_policy
from forgerl.trainer.checkpoint import latest_checkpoint, load_checkpoint
from forgerl.trainer.losses import LossFn
from forgerl.trainer.trainer import PreparedBatch, Trainer, resolve_device
from forgerl.types import Group


def join_trainer_group(config: Config, init: str, rank: int, timeout_s: float) -> None:
    """Join the data-parallel trainer's default process group of `trainer.workers` ranks at
    `init` (a file:// or tcp:// rendezvous) as `rank`: NCCL with GPU `rank` mod the visible
    GPUs when `trainer.device` resolves to CUDA, else gloo. Collectives and the rendezvous wait
    at most `timeout_s` seconds."""
    cuda = resolve_device(config.trainer.device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank,
                            world_size=config.trainer.workers,
                            timeout=datetime.timedelta(seconds=timeout_s))


def build_trainer(config: Config, model: Any) -> Trainer:
    """The [trainer] section's trainer for `model` (put in train mode) with the run's [reward]
    weights: a `DataParallelTrainer` (rank 0 of trainer.workers) when workers > 1 (gloo on CPU,
    NCCL with one GPU per rank), else a `Trainer`."""
    tc = config.trainer
    trainer = (DataParallelTrainer if tc.workers > 1 else Trainer)(
        model.train(), lr=tc.lr, weight_decay=tc.weight_decay,
        max_grad_norm=tc.max_grad_norm, loss_fn=tc.loss.build(),
        max_row_tokens=tc.max_row_tokens, merge_prefixes=tc.merge_prefixes,
        normalize_std=tc.normalize_std, device=tc.device,
        failed_reward=None if tc.failed_rollouts == "drop" else tc.failed_reward,
        rewards=config.reward.build(), mask_truncated=tc.truncated_turns == "mask",
        logprob_chunk_tokens=tc.logprob_chunk_tokens,
        activation_checkpointing=tc.activation_checkpointing,
        checkpoint_every_layers=tc.checkpoint_every_layers, autocast=tc.autocast,
        traces=config.reward.traces, routing_replay=tc.routing_replay)
    trainer.sharding = tc.sharding
    return trainer


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
    sharding = "replicate"
    """"replicate" (full replicas, one gradient all-reduce) or "fsdp" (see the module)."""
    _sharded = False
    _full: dict[str, torch.Tensor] | None = None  # rank 0, fsdp: the gathered weights

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """`Trainer.train_step` on every rank at once (rank 0 sends the groups); raises
        RuntimeError naming a worker's error when a worker failed or died."""
        return self._on_all_ranks(groups)

    def serve(self, message: list[Group] | str) -> None:
        """Ranks 1..: one message from rank 0, a step's groups or "checkpoint_state"."""
        self.checkpoint_state() if message == "checkpoint_state" else self.train_step(message)

    def _on_all_ranks(self, message: list[Group] | str) -> Any:
        if self.workers is None:  # ranks 1..: driven by rank 0
            return self._local(message)
        self.workers.send(message)
        try:
            result = self._local(message)
        except RuntimeError as e:  # e.g. gloo: a peer closed its connection
            self.workers.collect(e)
            raise
        self.workers.collect(None)
        return result

    def _local(self, message: list[Group] | str) -> Any:
        """This rank's part of `message`: the step, or its share of gathering the state."""
        # lazy: seconds to import; single-worker runs import this module too
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        if message == "checkpoint_state":
            if not self._sharded:
                return super().checkpoint_state()
            osd = get_optimizer_state_dict(self.model, self.optimizer, options=full)
            return self._full, _by_index(osd, self._names)
        if self.sharding == "fsdp" and not self._sharded:
            self._shard()
        metrics = super().train_step(message)
        if self._sharded:  # every rank joins the gather; rank 0 keeps the result
            weights = get_model_state_dict(self.model, options=full)
            self._full = weights if dist.get_rank() == 0 else None
        return metrics

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(model state dict, optimizer state dict) in full; under fsdp gathered from every
        rank (a collective: rank 0 asks the other ranks to join)."""
        if self.sharding != "fsdp":
            return super().checkpoint_state()
        return self._on_all_ranks("checkpoint_state")

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """`Trainer.state_dict_for_sync`; under fsdp the full weights gathered after the last
        step (rank 0)."""
        return self._full if self._sharded else super().state_dict_for_sync()

    def _shard(self) -> None:
        """FSDP2 over the default process group, keeping the AdamW state loaded so far."""
        # lazy: seconds to import; single-worker runs import this module too
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )
        from torch.distributed.fsdp import FSDPModule, fully_shard  # lazy: as the line above

        self._names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        state = self.optimizer.state_dict()
        if dist.get_rank() == 0:  # until the first gather (the unsharded tensors stay alive)
            self._full = super().state_dict_for_sync()
        for module in [m for m in self.model.modules()
                       if type(m).__name__ in (self.model._no_split_modules or ())]:
            fully_shard(module)
        fully_shard(self.model)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        hyper = {k: v for k, v in state["param_groups"][0].items()
                 if k not in ("params", "fused", "foreach")}  # kernel choice: AdamW's own
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters()
                                            if p.requires_grad])
        self.optimizer.param_groups[0].update(hyper)
        if state["state"]:
            set_optimizer_state_dict(self.model, self.optimizer, _by_name(state, self._names),
                                     options=StateDictOptions(full_state_dict=True))
        self.logprob_chunk_tokens = 0  # the chunked head runs outside the root's forward
        self._sharded = True

    def accumulate_gradients(self, batch: PreparedBatch,
                             loss_fn: LossFn | None = None) -> dict[str, float]:
        """Forward + backward of this worker's rows (with `loss_fn`, default the trainer's),
        then the all-reduced gradient sum: one flat fp32 buffer of shape (Σ numel of the
        parameters + 5 + samples,) (the gradients, then the loss, Σ ratio, Σ clipped, kept and
        non-finite token counts over this worker's loss tokens, then the per-sample entropy
        sums), summed over workers, and ratio_max reduced with MAX. Each parameter's
        .grad becomes its slice of that buffer."""
        rows = [r for r in batch.tree.rows if r.pred_pos.numel()]
        shares = balance_rows([r.input_ids.numel() for r in rows], dist.get_world_size())
        mine = [rows[i] for i in shares[dist.get_rank()]]
        missing = max(map(len, shares)) - len(mine)
        if self._sharded and batch.num_loss_tokens and missing:
            idle = replace(batch.tree, rows=[rows[0]] * missing)
            super().accumulate_gradients(  # zero loss and gradient, the same collectives
                replace(batch, tree=idle, advantages=torch.zeros_like(batch.advantages),
                        entropy_sums=None), loss_fn)
        local = super().accumulate_gradients(replace(batch, tree=replace(batch.tree, rows=mine)),
                                             loss_fn)
        params = [] if self._sharded else [p for g in self.optimizer.param_groups
                                           for p in g["params"]]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        before = batch.metrics.get("nonfinite_tokens", 0.0)  # dropped in `pack`, on every rank
        mine_n = sum(r.pred_pos.numel() for r in mine)  # this rank's loss tokens
        dropped = local.get("nonfinite_tokens", before) - before  # by the loss, here
        kept = float(mine_n) - dropped
        stats = torch.tensor([local["loss"], local["ratio_mean"] * kept,
                              local["clip_frac"] * kept, kept, dropped], device=self.device)
        sums = (batch.entropy_sums if batch.entropy_sums is not None
                else torch.zeros(len(batch.samples), dtype=torch.float64))
        flat = torch.cat([*(g.reshape(-1).float() for g in grads), stats,
                          sums.to(self.device, torch.float32)])
        dist.all_reduce(flat)
        ratio_max = torch.tensor([local["ratio_max"]], device=self.device)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()
        loss, ratio_sum, clipped, kept, dropped = flat[offset:offset + 5].tolist()
        if batch.entropy_sums is not None:
            batch.entropy_sums.copy_(flat[offset + 5:].double().cpu())
        return {"loss": loss, "ratio_mean": ratio_sum / max(kept, 1.0),
                "ratio_max": ratio_max.item(), "clip_frac": clipped / max(kept, 1.0),
                "nonfinite_tokens": before + dropped,
                "rows_per_worker_max": float(max(map(len, shares)))}


class TrainerWorkers:
    """Ranks 1..N-1 of a data-parallel trainer: spawned processes, each building the policy and
    a `DataParallelTrainer` from the same config (and the run's latest checkpoint, so replicas
    start equal), then running `train_step` on each step's groups from a pipe. This process
    joins as rank 0 (`join_trainer_group`: gloo, or NCCL on GPUs; rendezvous file in
    `run_dir`).

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
        join_trainer_group(config, init, 0, timeout_s)

    def send(self, message: list[Group] | str) -> None:
        """Hand one message (`DataParallelTrainer.serve`) to every worker (RuntimeError when
        one has gone)."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            try:
                conn.send(message)
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
    config = Config.model_validate(config_dump)
    join_trainer_group(config, init, rank, timeout_s)
    torch.manual_seed(config.seed)
    trainer = build_trainer(config, load_policy(config.model.path)[0])
    if (ckpt := latest_checkpoint(run_dir)) is not None:
        trainer.step = load_checkpoint(ckpt, trainer.model, trainer.optimizer)[0]
    while (message := conn.recv()) is not None:
        try:
            trainer.serve(message)
        except Exception as e:
            conn.send(f"{type(e).__name__}: {e}")
            raise SystemExit(1) from None
        conn.send(None)
    dist.destroy_process_group()


def _by_name(state: dict, names: list[str]) -> dict:
    """A torch optimizer state dict (params numbered in `names` order) keyed by name instead,
    as torch.distributed.checkpoint's full optimizer state dicts are."""
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def _by_index(state: dict, names: list[str]) -> dict:
    """The inverse of `_by_name`: what `torch.optim.Optimizer.load_state_dict` takes."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in state["param_groups"]]}
