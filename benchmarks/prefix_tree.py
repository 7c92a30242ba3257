"""Benchmark: prefix-tree merging vs plain packing vs a per-sample padded batch (Forge §3.2).

    python benchmarks/prefix_tree.py [--model tiny|smollm2] [--model-path DIR] [--quick]
                                     [--threads 1] [--pool RUN/pool.sqlite --tasks 4,5]

Workloads are agent-shaped: G rollouts x T turns on one shared prompt (random ids), one training
sample per turn (the turn's whole context + completion, loss on that turn's completion tokens,
as a per-completion trainer such as TRL builds them). Turn k+1's context extends turn k's.
`rewrite` rewrites the context after turn T/2: later turns restart from prompt + a summary,
so each rollout branches into two paths after the prompt. `--pool` replaces them with real
traffic: the recorded turns of a run's finished training trajectories (`--tasks`: the groups'
task indices, e.g. one step's), one sample per turn in the same way.

Methods, each one forward+backward over the whole batch with loss = mean policy logprob over
trained tokens (the same number for all three, printed as a check):
- padded: micro-batches of `--micro-batch` sequences right-padded to the longest, HF 2D
  attention mask; the lm_head runs from the first trained position on (TRL's logits_to_keep).
- packed: `build_tree_batch(merge=False)`: sequences packed into rows, no sharing.
- tree: `build_tree_batch(merge=True)`: the prefix tree, ancestors-only attention, run with
  the trainer's attention (`attention.preferred_attn_implementation`: block-sparse tree
  attention on CPU, FlexAttention on CUDA).
- tree-dense: the same tree under the model's own sdpa with the dense (N, N) tree mask.

Time is the median wall time of `--reps` fwd+bwd passes after one warm-up (`--no-warmup`).
Peak memory is the peak RSS (getrusage ru_maxrss) of a fresh worker process minus its RSS
after building the model and the batch, so each method starts from the same clean process
(CPU); on CUDA it is torch.cuda.max_memory_allocated minus the allocation before the pass.
On a shared 2-core machine pass `--threads 1`: with 2 threads, OpenMP stalls whenever another
process holds a core (measured here: 30x slower).
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import torch

from forgerl.trainer.attention import attn_implementation, preferred_attn_implementation
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.tree_forward import forward_logprobs


@dataclass(frozen=True)
class Workload:
    """G rollouts x T turns; lengths in tokens."""

    name: str
    group_size: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    observation_tokens: int
    rewrite: bool


def make_samples(
    w: Workload, vocab: int, seed: int = 0
) -> tuple[list[list[int]], list[list[bool]]]:
    """Per-turn samples (sequences_S_T) and their loss masks (completion tokens of that turn)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prompt = ids(w.prompt_tokens)
    sequences, needed = [], []
    for _ in range(w.group_size):
        context = list(prompt)
        for turn in range(w.turns):
            if w.rewrite and turn == w.turns // 2:
                context = prompt + ids(w.observation_tokens)  # summary replaces the history
            completion = ids(w.completion_tokens)
            sequences.append(context + completion)
            needed.append([False] * len(context) + [True] * len(completion))
            context = context + completion + ids(w.observation_tokens)
    return sequences, needed


def pool_samples(path: str, task_indices: list[int]) -> tuple[list[list[int]], list[list[bool]]]:
    """Per-turn samples of the finished trajectories of these groups in a run's SQLite pool:
    each turn's prompt_ids + completion_ids, loss on its completion ids."""
    from forgerl.datapool.sqlite import SQLitePool

    pool = SQLitePool(path)
    sequences, needed = [], []
    for index in task_indices:
        for traj in pool.get_group(index).trajectories:
            for c in traj.completions if traj.status == "finished" else []:
                sequences.append(c.prompt_ids + c.completion_ids)
                needed.append([False] * len(c.prompt_ids) + [True] * len(c.completion_ids))
    pool.close()
    return sequences, needed


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.model_path:
        from forgerl.models import load_pretrained

        return load_pretrained(args.model_path)[0]
    if args.model == "smollm2":
        from forgerl.models import load_pretrained

        return load_pretrained("smollm2")[0]
    from forgerl.models import build_tiny_model

    return build_tiny_model()


def padded_loss(model, sequences, needed, micro_batch: int, pad_id: int = 0) -> float:
    """Mean trained-token logprob over right-padded micro-batches; backward per micro-batch."""
    total = sum(sum(m[1:]) for m in needed)
    loss_sum = 0.0
    for b in range(0, len(sequences), micro_batch):
        seqs, masks = sequences[b : b + micro_batch], needed[b : b + micro_batch]
        length = max(map(len, seqs))
        input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), length), dtype=torch.long)
        trained = torch.zeros((len(seqs), length), dtype=torch.bool)
        for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
            input_ids[i, : len(s)] = torch.tensor(s)
            attention[i, : len(s)] = 1
            trained[i, : len(s)] = torch.tensor(m)
        start = max(int(trained.any(0).nonzero()[0]) - 1, 0)  # first position whose logits count
        dev = next(model.parameters()).device
        hidden = model.get_decoder()(
            input_ids=input_ids.to(dev), attention_mask=attention.to(dev), use_cache=False
        ).last_hidden_state  # (B, L, H)
        logits = model.get_output_embeddings()(hidden[:, start:-1]).float()  # (B, L-1-start, V)
        lp = torch.log_softmax(logits, -1).gather(2, input_ids[:, start + 1 :, None].to(dev))[
            ..., 0
        ]
        loss = -(lp * trained[:, start + 1 :].to(dev)).sum() / total
        loss.backward()
        loss_sum += loss.item()
    return loss_sum


def tree_loss(model, batch, impl: str) -> float:
    total = sum(row.pred_pos.numel() for row in batch.rows)
    loss_sum = 0.0
    for row in batch.rows:
        with attn_implementation(model, impl):
            loss = -forward_logprobs(model, row).sum() / total
            loss.backward()
        loss_sum += loss.item()
    return loss_sum


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure(args: argparse.Namespace, workload: Workload, method: str) -> dict:
    """Run in a fresh process: build model + batch, warm up, time `reps` fwd+bwd passes."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(args)
    if torch.cuda.is_available():
        model = model.cuda()
    model.train()
    sequences, needed = (pool_samples(args.pool, args.tasks) if workload.name == "pool"
                         else make_samples(workload, model.config.vocab_size))
    info = {"seqs": len(sequences), "input": sum(map(len, sequences))}
    if method == "padded":
        mb = args.micro_batch
        info["computed"] = sum(
            len(sequences[b : b + mb]) * max(map(len, sequences[b : b + mb]))
            for b in range(0, len(sequences), mb)
        )
        info["rows"] = -(-len(sequences) // mb)

        def step() -> float:
            return padded_loss(model, sequences, needed, mb)
    else:
        batch = build_tree_batch(sequences, args.max_row_tokens, needed,
                                 merge=method.startswith("tree"))
        info["computed"], info["rows"] = batch.num_tree_tokens, len(batch.rows)
        impl = (model.config._attn_implementation if method == "tree-dense"
                else preferred_attn_implementation(model, next(model.parameters()).device))

        def step() -> float:
            return tree_loss(model, batch, impl)

    cuda = torch.cuda.is_available()
    base = torch.cuda.memory_allocated() if cuda else _rss_mib()
    times, loss = [], 0.0
    for rep in range(args.reps + int(args.warmup)):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if rep >= int(args.warmup):  # rep 0 is the warm-up
            times.append(time.perf_counter() - start)
    peak = (
        (torch.cuda.max_memory_allocated() - base) / 2**20
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    )
    return info | {"time": statistics.median(times), "peak": peak, "loss": loss}


def workloads(args: argparse.Namespace) -> list[Workload]:
    """extend / rewrite at the default (or --quick) lengths; --prompt-tokens etc. override;
    with --pool only the recorded one ("pool"; its shape fields unused)."""
    if args.pool:
        return [Workload("pool", 0, 0, 0, 0, 0, rewrite=False)]
    lengths = (384, 24, 8) if args.quick else (1536, 128, 64)
    prompt, completion, observation = (
        given or default
        for given, default in zip(
            (args.prompt_tokens, args.completion_tokens, args.observation_tokens),
            lengths,
            strict=True,
        )
    )
    shape = {
        "group_size": 8,
        "turns": 6,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "observation_tokens": observation,
    }
    both = [Workload("extend", **shape, rewrite=False), Workload("rewrite", **shape, rewrite=True)]
    return [w for w in both if args.workload in (w.name, "both")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--model-path", default=None, help="a local HF model folder")
    parser.add_argument("--quick", action="store_true", help="shorter sequences, one timed rep")
    parser.add_argument(
        "--max-row-tokens", type=int, default=None, help="default 4096 (quick 1024)"
    )
    parser.add_argument("--micro-batch", type=int, default=8, help="padded: sequences per pass")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 avoids OpenMP stalls when other processes busy the cores)",
    )
    parser.add_argument("--workload", choices=["extend", "rewrite", "both"], default="both")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    for name in ("prompt", "completion", "observation"):
        parser.add_argument(f"--{name}-tokens", type=int, default=None, help="override length")
    parser.add_argument("--pool", default=None, help="a run's pool.sqlite: real turns")
    parser.add_argument("--tasks", type=lambda t: [int(i) for i in t.split(",")], default=[0],
                        help="--pool: comma list of training task indices (groups)")
    parser.add_argument("--reps", type=int, default=None, help="timed reps (default 1 / 3)")
    parser.add_argument("--methods", default="padded,packed,tree-dense,tree",
                        help="comma list; speedup is against the first one run")
    args = parser.parse_args()
    args.reps = args.reps or (1 if args.quick else 3)
    args.max_row_tokens = args.max_row_tokens or (1024 if args.quick else 4096)
    w0 = workloads(args)[0]
    print(
        f"model={args.model_path or args.model} reps={args.reps} warmup={args.warmup} "
        f"micro_batch={args.micro_batch} "
        f"max_row_tokens={args.max_row_tokens} "
        + (f"pool={args.pool} tasks={args.tasks} " if args.pool else
           f"G={w0.group_size} turns={w0.turns} prompt/completion/observation tokens="
           f"{w0.prompt_tokens}/{w0.completion_tokens}/{w0.observation_tokens} ")
        + f"device={'cuda' if torch.cuda.is_available() else 'cpu'} "
        f"threads={args.threads or torch.get_num_threads()}"
    )
    header = (
        f"{'workload':<9}{'method':<11}{'seqs':>5}{'rows':>5}{'input tok':>10}{'computed':>10}"
        f"{'compress':>9}{'fwd+bwd s':>10}{'speedup':>8}{'peak MiB':>9}{'loss':>9}"
    )
    print(header)
    ctx = get_context("spawn")
    for w in workloads(args):
        ref_time = None
        for method in args.methods.split(","):
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                r = pool.submit(measure, args, w, method).result()
            ref_time = ref_time or r["time"]
            print(
                f"{w.name:<9}{method:<11}{r['seqs']:>5}{r['rows']:>5}{r['input']:>10}"
                f"{r['computed']:>10}{r['input'] / r['computed']:>8.2f}x{r['time']:>10.2f}"
                f"{ref_time / r['time']:>7.2f}x{r['peak']:>9.0f}{r['loss']:>9.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
