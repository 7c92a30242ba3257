"""LocalEngine decode throughput: completion tokens per second at batch 1 and batch 8.

Run: `.venv/bin/python benchmarks/engine_throughput.py [--model-dir DIR] [--tokens N]`.
Without --model-dir it uses the tiny random model from forgerl.models; with it, any local HF
causal-LM folder (e.g. the converted SmolLM2-135M). Prints one row per batch size and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from transformers import AutoModelForCausalLM

from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model
from forgerl.types import SamplingParams


async def tokens_per_second(engine: LocalEngine, batch: int, tokens: int) -> float:
    """Run `batch` concurrent sampled (T = 1) requests of `tokens` tokens each; return tok/s."""
    params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=0)
    prompts = [[1, *range(10 + i, 40 + i)] for i in range(batch)]
    await engine.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    return sum(len(o.completion_ids) for o in outs) / (time.perf_counter() - start)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    if args.model_dir:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    else:
        model = build_tiny_model()
    engine = LocalEngine(model, max_model_len=1024)
    rates = {b: await tokens_per_second(engine, b, args.tokens) for b in (1, 8)}
    await engine.close()
    print(f"{'batch':>5} {'tok/s':>9}")
    for b, r in rates.items():
        print(f"{b:>5} {r:>9.1f}")
    print(f"batch 8 / batch 1 = {rates[8] / rates[1]:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
