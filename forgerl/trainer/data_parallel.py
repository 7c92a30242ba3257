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

from dataclasses import replace

import torch
import torch.distributed as dist

from forgerl.trainer.trainer import PreparedBatch, Trainer


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
    workers), plus `rows_per_worker_max`."""

    def accumulate_gradients(self, batch: PreparedBatch) -> dict[str, float]:
        """Forward + backward of this worker's rows, then the all-reduced gradient sum."""
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
