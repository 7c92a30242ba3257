"""Prefill/decode disaggregation: decode inter-token latency while long prompts keep arriving.

Run: `.venv/bin/python benchmarks/disaggregation.py [--seconds 20] [--streams 4]
[--prompt 256] [--every 0.5]`.

SmolLM2-135M fp32 (the packaged model; `--tiny` for the random 2-layer test model). All
settings in this one run, back to back, on the same traffic: `--streams` running greedy decode
streams (8-token prompts, 64 tokens each, restarted when done), and a new long prompt
(`--prompt` distinct random ids, 2 completion tokens) `--every` seconds after the previous one
finished (one in flight at a time, so the prefill queue stays bounded). Measured in the caller's
process: the gaps between consecutive tokens of the running streams (inter-token latency, p50 /
p99 / max) and the decode tokens per second, against
- mixed: one `LocalEngine` in this process with 2 torch threads, then with 1 (prefills and
  decode steps on one worker thread, so a long prompt's prefill stalls every running stream;
  2 threads is the same total as the disaggregated pair, 1 thread avoids two OpenMP threads
  spinning on a busy 2-core machine), and
- disaggregated: a `DisaggregatedEngine` (a prefill process and a decode process, 1 torch
  thread each: the same 2 threads in all), the prompt's KV handed over in shared memory;
  its hand-off time per token (the prefill process's send to the KV's arrival in the decode
  process) and bytes per token come from the engine's stats.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from forgerl.engines.disaggregated import DisaggregatedEngine
from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model, load_pretrained
from forgerl.types import SamplingParams

STREAM = SamplingParams(0.0, max_tokens=64)
LONG = SamplingParams(0.0, max_tokens=2)


async def stream_forever(engine, prompt: list[int], stop: float, gaps: list[float]) -> int:
    """Decode `prompt` again and again until `stop` (perf_counter); append token gaps; tokens."""
    tokens = 0
    while time.perf_counter() < stop:
        last = None
        async for _ in engine.stream(prompt, STREAM):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last, tokens = now, tokens + 1
    return tokens


async def long_prompts(engine, length: int, every: float, stop: float, vocab: int,
                       seed: int) -> int:
    """Until `stop`: send a new distinct long prompt, wait for its completion, pause `every`
    seconds (one long prompt in flight at a time: the prefill queue stays bounded); prompts."""
    rng, sent = random.Random(seed), 0
    while time.perf_counter() < stop:
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(length - 1)]
        await engine.generate(prompt, LONG)
        sent += 1
        await asyncio.sleep(every)
    return sent


async def measure(engine, args: argparse.Namespace, vocab: int) -> dict:
    """Warm up, then run the streams and the long prompts for args.seconds."""
    await engine.generate([1, 5, 6, 7], SamplingParams(0.0, max_tokens=4))
    start = time.perf_counter()
    stop = start + args.seconds
    gaps: list[float] = []
    streams = [stream_forever(engine, [1, *range(10 + 8 * i, 17 + 8 * i)], stop, gaps)
               for i in range(args.streams)]
    *tokens, sent = await asyncio.gather(*streams, long_prompts(engine, args.prompt, args.every,
                                                                stop, vocab, seed=0))
    seconds = time.perf_counter() - start
    q = statistics.quantiles(gaps, n=100)
    return {"p50_ms": 1e3 * q[49], "p99_ms": 1e3 * q[98], "max_ms": 1e3 * max(gaps),
            "tok_s": sum(tokens) / seconds, "prompts": sent}


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model = build_tiny_model() if args.tiny else load_pretrained("smollm2")[0]
    vocab = model.get_input_embeddings().num_embeddings
    max_len = args.prompt + 128
    rows = {}
    for threads in (2, 1):  # the mixed engine's worker: both threads, then one
        torch.set_num_threads(threads)
        mixed = LocalEngine(model, max_model_len=max_len, max_batch_size=16)
        rows[f"mixed (1 process, {threads} thread{'s' * (threads > 1)})"] = await measure(
            mixed, args, vocab)
        await mixed.close()
    torch.set_num_threads(1)
    start = time.perf_counter()
    disagg = DisaggregatedEngine(model, max_model_len=max_len, max_batch_size=16,
                                 prefix_cache_tokens=32768, threads=1)
    started = time.perf_counter() - start
    rows["disaggregated (2 processes, 1 thread each)"] = await measure(disagg, args, vocab)
    stats = dict(disagg.stats)
    await disagg.close()
    print(f"model: {'tiny' if args.tiny else 'SmolLM2-135M'} fp32; {args.streams} streams, a "
          f"{args.prompt}-token prompt {args.every} s after the last, {args.seconds} s per setting")
    print(f"{'setting':44} {'ITL p50 ms':>10} {'p99 ms':>8} {'max ms':>8} {'tok/s':>7} "
          f"{'prompts':>7}")
    for name, r in rows.items():
        print(f"{name:44} {r['p50_ms']:10.1f} {r['p99_ms']:8.1f} {r['max_ms']:8.1f} "
              f"{r['tok_s']:7.1f} {r['prompts']:7d}")
    *mixed_rows, d = rows.values()
    for threads, m in zip((2, 1), mixed_rows, strict=True):
        print(f"ratio disaggregated / mixed at {threads} thread(s): p50 "
              f"{d['p50_ms'] / m['p50_ms']:.2f}, p99 {d['p99_ms'] / m['p99_ms']:.2f}, "
              f"tok/s {d['tok_s'] / m['tok_s']:.2f}")
    tokens = max(stats["handoff_tokens"], 1)
    print(f"hand-off: {stats['handoffs']} prompts, {stats['handoff_tokens']} tokens, "
          f"{1e6 * stats['handoff_seconds'] / tokens:.2f} us/token, "
          f"{stats['handoff_bytes'] / tokens / 1024:.1f} KiB/token, "
          f"{1e3 * stats['handoff_seconds'] / max(stats['handoffs'], 1):.2f} ms/prompt; prefill "
          f"process {1e6 * stats['prefill_process_seconds'] / tokens:.1f} us/token; stale "
          f"{stats['handoffs_stale']}; decode-side prefill tokens {stats['prefill_tokens']}; "
          f"workers started in {started:.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--tiny", action="store_true")
    asyncio.run(main(parser.parse_args()))
