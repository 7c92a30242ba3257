"""8 LoRA runs on one base model: concurrent (one batch) against one after another (issue 50).

Each run owns a LoRA adapter (rank 8, alpha 16, q/k/v/o) on one frozen base, in one process
with one `LocalEngine` (its own copy of the base) and one trainer copy wrapped by
`forgerl.lora.MultiLoRA`. A run's step samples a group of G completions of its own prompt under
its adapter, rewards each completion by the share of its tokens whose id is ≡ run (mod runs),
takes a policy-gradient step (advantage = reward - group mean, AdamW) on its adapter and syncs
the adapter to the engine (`load_adapter`, a new version).

- concurrent: per round, all runs sample at once (runs·G rows of 8 adapters decoded in one
  batch), then their train steps and syncs run back to back;
- grouped: as concurrent, but the runs' train steps are one forward and backward over all their
  rows (`MultiLoRA.active` with one adapter per row), then one AdamW step per adapter;
- sequential: run 1 takes all its steps, then run 2, ... (G rows per decode batch);
- one: a single run alone (its process's peak RSS x runs estimates runs separate processes,
  each with its own copy of the base, instead of one shared base).

Equal total steps (runs x steps) and tokens in all. Each mode runs in its own child process so
its peak RSS (ru_maxrss) is its own (the base and its engine copy included); one torch thread.

Run: `.venv/bin/python benchmarks/multilora.py [--model tiny|smollm2] [--runs 8] [--steps 3]
[--group 4] [--tokens 16] [--repeats 1]`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import resource
import subprocess
import sys
import time

import torch

from forgerl.engines.local import LocalEngine
from forgerl.lora import MultiLoRA
from forgerl.models import build_tiny_model, load_pretrained
from forgerl.types import SamplingParams

RANK, ALPHA, PROMPT = 8, 16.0, 24
MODES = ("concurrent", "grouped", "sequential", "one")


def _model(name: str) -> torch.nn.Module:
    return build_tiny_model(head_std=0.2) if name == "tiny" else load_pretrained(name)[0]


def _train_step(lora: MultiLoRA, opts: list, runs: int, prompts: list[list[int]],
                groups: dict[int, list[list[int]]]) -> list[float]:
    """One policy-gradient step of each adapter in `groups` (run → its group's completions),
    all rows in one forward and backward (one run: a single-tenant step); returns each run's
    mean reward. Each run's loss is its own group's mean, so its gradient is its own."""
    ids = torch.tensor([prompts[r] + c for r, group in groups.items() for c in group])
    with lora.active([f"run{r}" for r, group in groups.items() for _ in group]):
        logits = lora.model(input_ids=ids).logits[:, PROMPT - 1:-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, PROMPT:, None])[..., 0]
    loss, row, means = 0.0, 0, []
    for r, group in groups.items():
        rewards = torch.tensor([sum(t % runs == r for t in c) / len(c) for c in group])
        adv = rewards - rewards.mean()
        loss = loss - (adv[:, None] * logp[row:row + len(group)]).mean()
        row += len(group)
        means.append(float(rewards.mean()))
    loss.backward()
    for r in groups:
        opts[r].step()
        opts[r].zero_grad()
    return means


async def _mode(args: argparse.Namespace, mode: str) -> dict:
    """The fastest of `args.repeats` runs of `mode` (a fresh engine and adapters each), with
    this process's peak RSS."""
    base = _model(args.model)
    results = [await _once(args, mode, base) for _ in range(args.repeats)]
    best = min(results, key=lambda r: r["wall_s"])
    return best | {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


async def _once(args: argparse.Namespace, mode: str, base: torch.nn.Module) -> dict:
    runs = 1 if mode == "one" else args.runs
    engine = LocalEngine(base, max_model_len=PROMPT + args.tokens + 8,
                         max_batch_size=runs * args.group)
    lora = MultiLoRA(copy.deepcopy(base))
    vocab = lora.model.config.vocab_size
    prompts, opts = [], []
    for r in range(runs):
        lora.add(f"run{r}", RANK, ALPHA, seed=r)
        opts.append(torch.optim.AdamW(lora.parameters(f"run{r}"), lr=1e-3))
        prompts.append(torch.randint(3, vocab, (PROMPT,),
                                     generator=torch.Generator().manual_seed(r)).tolist())
        await engine.load_adapter(f"run{r}", lora.state_dict(f"run{r}"), 0, ALPHA)
    sample_s = train_s = 0.0
    tokens, rewards = 0, []

    async def sample(r: int, step: int) -> list[list[int]]:
        params = [SamplingParams(1.0, max_tokens=args.tokens, seed=1000 * step + g)
                  for g in range(args.group)]
        outs = await asyncio.gather(*(engine.generate(prompts[r], p, adapter=f"run{r}")
                                      for p in params))
        return [o.completion_ids for o in outs]

    async def train(step: int, groups: dict[int, list[list[int]]]) -> None:
        nonlocal train_s
        start = time.perf_counter()
        rewards.extend(_train_step(lora, opts, runs, prompts, groups))
        for r in groups:
            await engine.load_adapter(f"run{r}", lora.state_dict(f"run{r}"), step + 1, ALPHA)
        train_s += time.perf_counter() - start

    start = time.perf_counter()
    if mode in ("concurrent", "grouped"):
        for step in range(args.steps):
            t = time.perf_counter()
            groups = await asyncio.gather(*(sample(r, step) for r in range(runs)))
            sample_s += time.perf_counter() - t
            tokens += sum(len(c) for group in groups for c in group)
            if mode == "grouped":  # one forward/backward of all runs' rows (mixed adapters)
                await train(step, dict(enumerate(groups)))
            else:  # the runs' train steps back to back
                for r, group in enumerate(groups):
                    await train(step, {r: group})
    else:
        for r in range(runs):
            for step in range(args.steps):
                t = time.perf_counter()
                group = await sample(r, step)
                sample_s += time.perf_counter() - t
                tokens += sum(map(len, group))
                await train(step, {r: group})
    wall = time.perf_counter() - start
    occupancy = engine.stats["decode_rows"] / max(engine.stats["decode_steps"], 1)
    await engine.close()
    return {"mode": mode, "wall_s": wall, "sample_s": sample_s, "train_s": train_s,
            "tokens": tokens, "tokens_per_s": tokens / wall, "sample_tokens_per_s":
            tokens / sample_s, "rows_per_decode_step": occupancy,
            "mean_reward_last": sum(rewards[-runs:]) / runs,
            "base_mb": sum(p.numel() * p.element_size() for p in lora.model.parameters()) / 2**20,
            "adapter_mb": sum(p.numel() * p.element_size() for p in lora.parameters("run0"))
            / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny or smollm2")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="report each mode's fastest")
    parser.add_argument("--child", choices=MODES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(asyncio.run(_mode(args, args.child))))
        return
    rows = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", mode]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    c, g, s, one = (rows[m] for m in MODES)
    print(f"model {args.model}, {args.runs} runs x {args.steps} steps, group {args.group}, "
          f"{args.tokens} tokens, LoRA rank {RANK}; one torch thread")
    print("| mode | wall s | sample s | train+sync s | tokens/s | rows/decode step | "
          "peak RSS MB |\n|---|---|---|---|---|---|---|")
    for r in (c, g, s):
        print(f"| {r['mode']} | {r['wall_s']:.2f} | {r['sample_s']:.2f} | {r['train_s']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['rows_per_decode_step']:.1f} | "
              f"{r['peak_rss_mb']:.0f} |")
    print(f"\nconcurrent / sequential: wall {c['wall_s'] / s['wall_s']:.2f}x, tokens/s "
          f"{c['tokens_per_s'] / s['tokens_per_s']:.2f}x, sampling "
          f"{c['sample_s'] / s['sample_s']:.2f}x of the time; grouped / sequential: wall "
          f"{g['wall_s'] / s['wall_s']:.2f}x, train+sync {g['train_s'] / s['train_s']:.2f}x")
    print(f"one run alone: peak RSS {one['peak_rss_mb']:.0f} MB; {args.runs} separate processes "
          f"(a base copy each) ≈ {args.runs * one['peak_rss_mb']:.0f} MB vs "
          f"{c['peak_rss_mb']:.0f} MB shared; base weights {c['base_mb']:.1f} MB per copy "
          f"(engine + trainer: 2 copies), one adapter {c['adapter_mb']:.2f} MB (+ AdamW 2x)")


if __name__ == "__main__":
    main()
