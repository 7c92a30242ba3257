"""8 LoRA runs on one base model: concurrent (one batch) against one after another (issue 50).

Each run owns a LoRA adapter (rank 8, alpha 16, q/k/v/o) on one frozen base, in one process
with one `LocalEngine` (its own copy of the base) and one trainer copy wrapped by
`forgerl.lora.MultiLoRA`. A run's step samples a group of G completions of its own prompt under
its adapter, rewards each completion by the share of its tokens whose id is ≡ run (mod runs),
takes a policy-gradient step (advantage = reward - group mean, AdamW) on its adapter and syncs
the adapter to the engine (`load_adapter`, a new version).

- concurrent: per round, all runs sample at once (runs·G rows of 8 adapters decoded in one
  batch), then their train steps and syncs run back to back;
- sequential: run 1 takes all its steps, then run 2, ... (G rows per decode batch);
- one: a single run alone (its process's peak RSS x runs estimates runs separate processes,
  each with its own copy of the base, instead of one shared base).

Equal total steps (runs x steps) and tokens in both. Each mode runs in its own child process so
its peak RSS (ru_maxrss) is its own; one torch thread.

Run: `.venv/bin/python benchmarks/multilora.py [--model tiny|smollm2] [--runs 8] [--steps 3]
[--group 4] [--tokens 16]`.
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


def _model(name: str) -> torch.nn.Module:
    return build_tiny_model(head_std=0.2) if name == "tiny" else load_pretrained(name)[0]


def _train_step(lora: MultiLoRA, opt: torch.optim.Optimizer, run: int, runs: int,
                prompt: list[int], completions: list[list[int]]) -> float:
    """One policy-gradient step of adapter `run` on its group; returns the mean reward."""
    rewards = torch.tensor([sum(t % runs == run for t in c) / len(c) for c in completions])
    adv = rewards - rewards.mean()
    ids = torch.tensor([prompt + c for c in completions])  # (G, P + T), no padding
    with lora.active(f"run{run}"):
        logits = lora.model(input_ids=ids).logits[:, len(prompt) - 1:-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt):, None])[..., 0]
    loss = -(adv[:, None] * logp).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(rewards.mean())


async def _mode(args: argparse.Namespace, mode: str) -> dict:
    base = _model(args.model)
    runs = 1 if mode == "one" else args.runs
    engine = LocalEngine(base, max_model_len=PROMPT + args.tokens + 8,
                         max_batch_size=runs * args.group)
    lora = MultiLoRA(copy.deepcopy(base))
    del base
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

    async def train(r: int, step: int, group: list[list[int]]) -> None:
        nonlocal train_s
        start = time.perf_counter()
        rewards.append(_train_step(lora, opts[r], r, runs, prompts[r], group))
        await engine.load_adapter(f"run{r}", lora.state_dict(f"run{r}"), step + 1, ALPHA)
        train_s += time.perf_counter() - start

    start = time.perf_counter()
    if mode == "concurrent":
        for step in range(args.steps):
            t = time.perf_counter()
            groups = await asyncio.gather(*(sample(r, step) for r in range(runs)))
            sample_s += time.perf_counter() - t
            for r, group in enumerate(groups):
                tokens += sum(map(len, group))
                await train(r, step, group)
    else:
        for r in range(runs):
            for step in range(args.steps):
                t = time.perf_counter()
                group = await sample(r, step)
                sample_s += time.perf_counter() - t
                tokens += sum(map(len, group))
                await train(r, step, group)
    wall = time.perf_counter() - start
    occupancy = engine.stats["decode_rows"] / max(engine.stats["decode_steps"], 1)
    await engine.close()
    return {"mode": mode, "wall_s": wall, "sample_s": sample_s, "train_s": train_s,
            "tokens": tokens, "tokens_per_s": tokens / wall, "sample_tokens_per_s":
            tokens / sample_s, "rows_per_decode_step": occupancy,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
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
    parser.add_argument("--child", choices=("concurrent", "sequential", "one"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(asyncio.run(_mode(args, args.child))))
        return
    rows = {}
    for mode in ("concurrent", "sequential", "one"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", mode]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    c, s, one = rows["concurrent"], rows["sequential"], rows["one"]
    print(f"model {args.model}, {args.runs} runs x {args.steps} steps, group {args.group}, "
          f"{args.tokens} tokens, LoRA rank {RANK}; one torch thread")
    print("| mode | wall s | sample s | train+sync s | tokens/s | rows/decode step | "
          "peak RSS MB |\n|---|---|---|---|---|---|---|")
    for r in (c, s):
        print(f"| {r['mode']} | {r['wall_s']:.2f} | {r['sample_s']:.2f} | {r['train_s']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['rows_per_decode_step']:.1f} | "
              f"{r['peak_rss_mb']:.0f} |")
    print(f"\nconcurrent / sequential: wall {c['wall_s'] / s['wall_s']:.2f}x, tokens/s "
          f"{c['tokens_per_s'] / s['tokens_per_s']:.2f}x, sampling "
          f"{c['sample_s'] / s['sample_s']:.2f}x of the time")
    print(f"one run alone: peak RSS {one['peak_rss_mb']:.0f} MB; {args.runs} separate processes "
          f"(a base copy each) ≈ {args.runs * one['peak_rss_mb']:.0f} MB vs "
          f"{c['peak_rss_mb']:.0f} MB shared; base weights {c['base_mb']:.1f} MB per copy "
          f"(engine + trainer: 2 copies), one adapter {c['adapter_mb']:.2f} MB (+ AdamW 2x)")


if __name__ == "__main__":
    main()
