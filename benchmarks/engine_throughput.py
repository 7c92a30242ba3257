"""LocalEngine benchmarks: decode throughput, and prefix caching (KV reuse) on shared prompts.

Run: `.venv/bin/python benchmarks/engine_throughput.py [--mode decode|prefix] [--model M]`.
--model: "tiny" (the random model from forgerl.models, default), "smollm2" (the packaged
SmolLM2-135M-Instruct, fp32) or a local HF causal-LM folder. --threads sets torch's intra-op
threads (SmolLM2 on the 2-core box: 2).

decode: completion tokens per second at batch 1 and batch 8, and the ratio.
prefix: wall time of N concurrent greedy requests (N = 8, 16) whose prompts share a
`--shared`-token prefix (a system prompt) plus a `--suffix`-token distinct tail, `--tokens`
output tokens each, on a cold engine: cache off, cache on, and cache on without group waves
(newcomers of one step prefilled as one batch, so only later arrivals hit). Prints a table with
the speedup of "on" over "off"; outputs of all modes are checked to be token-identical.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch

from forgerl.engines.local import LocalEngine
from forgerl.engines.local import batcher as local
from forgerl.models import build_tiny_model, load_pretrained
from forgerl.types import GenerateOutput, SamplingParams


async def tokens_per_second(engine: LocalEngine, batch: int, tokens: int) -> float:
    """Run `batch` concurrent sampled (T = 1) requests of `tokens` tokens each; return tok/s."""
    params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=0)
    prompts = [[1, *range(10 + i, 40 + i)] for i in range(batch)]
    await engine.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    return sum(len(o.completion_ids) for o in outs) / (time.perf_counter() - start)


async def timed_group(
    model: torch.nn.Module, prompts: list[list[int]], tokens: int, cache: int
) -> tuple[float, list[GenerateOutput], dict[str, int]]:
    """Wall seconds for all `prompts` sent at once to a fresh engine (after a warm-up request
    that shares nothing with them), their greedy outputs, and the engine's counters."""
    engine = LocalEngine(model, max_model_len=1024, prefix_cache_tokens=cache)
    await engine.generate([2, 3], SamplingParams(max_tokens=2))
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    start = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    elapsed = time.perf_counter() - start
    await engine.close()
    return elapsed, list(outs), dict(engine.stats)


async def prefix_table(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Print wall time off / on / on-without-waves for 8 and 16 concurrent shared-prefix prompts."""
    vocab = model.get_input_embeddings().num_embeddings
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(args.shared)]
    print(f"prompt = {args.shared} shared + {args.suffix} distinct tokens, {args.tokens} out")
    print(
        f"{'N':>3} {'off s':>7} {'on s':>7} {'no-wave s':>9} {'on/off speedup':>15} {'hit tok':>8}"
    )
    for n in (8, 16):
        prompts = [shared + [rng.randrange(3, vocab) for _ in range(args.suffix)] for _ in range(n)]
        off, ref, _ = await timed_group(model, prompts, args.tokens, 0)
        on, outs, stats = await timed_group(model, prompts, args.tokens, 32768)
        local.WAVE_MIN_SHARED = 10**9
        nowave, outs2, _ = await timed_group(model, prompts, args.tokens, 32768)
        local.WAVE_MIN_SHARED = 16
        same = all(
            a.completion_ids == b.completion_ids for a, b in zip(ref * 2, outs + outs2, strict=True)
        )
        print(
            f"{n:>3} {off:>7.2f} {on:>7.2f} {nowave:>9.2f} {off / on:>14.2f}x "
            f"{stats['prefix_hit_tokens']:>8}{'' if same else '  OUTPUTS DIFFER'}"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["decode", "prefix"], default="decode")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="output tokens per request")
    parser.add_argument("--shared", type=int, default=200)
    parser.add_argument("--suffix", type=int, default=20)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_tiny_model() if args.model == "tiny" else load_pretrained(args.model)[0]
    if args.mode == "prefix":
        args.tokens = args.tokens or 16
        await prefix_table(model, args)
        return
    engine = LocalEngine(model, max_model_len=1024)
    rates = {b: await tokens_per_second(engine, b, args.tokens or 128) for b in (1, 8)}
    await engine.close()
    print(f"{'batch':>5} {'tok/s':>9}")
    for b, r in rates.items():
        print(f"{b:>5} {r:>9.1f}")
    print(f"batch 8 / batch 1 = {rates[8] / rates[1]:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
