"""Prefill/decode disaggregation: decode inter-token latency while long prompts keep arriving.

Run: `.venv/bin/python benchmarks/disaggregation.py [--seconds 15] [--rounds 2] [--streams 4]
[--prompt 256] [--every 0.5]`.

SmolLM2-135M fp32 (the packaged model; `--tiny` for the random 2-layer test model). All
settings in this one run, `--rounds` rounds of `--seconds` each, interleaved (the machine's
load drifts), on the same traffic: `--streams` running greedy decode
streams (8-token prompts, 64 tokens each, restarted when done), and, once every stream has its
first token, a new long prompt
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


async def stream_forever(engine, prompt: list[int], stop: float, gaps: list[float],
                         started: asyncio.Event) -> int:
    """Decode `prompt` again and again until `stop` (perf_counter); append token gaps; set
    `started` at the first token; tokens."""
    tokens = 0
    while time.perf_counter() < stop:
        last = None
        async for _ in engine.stream(prompt, STREAM):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last, tokens = now, tokens + 1
            started.set()
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


async def measure(engine, args: argparse.Namespace, vocab: int, row: dict) -> None:
    """Warm up, then run the streams and the long prompts for args.seconds; add the token gaps,
    tokens, seconds and prompts sent to `row`."""
    await engine.generate([1, 5, 6, 7], SamplingParams(0.0, max_tokens=4))
    start = time.perf_counter()
    stop = start + args.seconds
    started = [asyncio.Event() for _ in range(args.streams)]
    streams = [asyncio.create_task(stream_forever(engine, [1, *range(10 + 8 * i, 17 + 8 * i)],
                                                  stop, row["gaps"], started[i]))
               for i in range(args.streams)]
    await asyncio.gather(*(event.wait() for event in started))  # then the long prompts start
    sent = await long_prompts(engine, args.prompt, args.every, stop, vocab, len(row["gaps"]))
    tokens = await asyncio.gather(*streams)
    row["tokens"] += sum(tokens)
    row["seconds"] += time.perf_counter() - start
    row["prompts"] += sent


def summary(row: dict) -> dict:
    """ITL quantiles (ms), decode tokens/s and prompts of one setting's pooled rounds."""
    q = statistics.quantiles(row["gaps"], n=100)
    return {"p50": 1e3 * q[49], "p90": 1e3 * q[89], "p99": 1e3 * q[98],
            "max": 1e3 * max(row["gaps"]), "tok_s": row["tokens"] / row["seconds"],
            "prompts": row["prompts"]}


async def main(args: argparse.Namespace) -> None:
    model = build_tiny_model() if args.tiny else load_pretrained("smollm2")[0]
    vocab = model.get_input_embeddings().num_embeddings
    max_len = args.prompt + 128
    names = ["mixed (1 process, 2 threads)", "mixed (1 process, 1 thread)",
             "disaggregated (2 processes, 1 thread each)"]
    rows = {n: {"gaps": [], "tokens": 0, "seconds": 0.0, "prompts": 0} for n in names}
    torch.set_num_threads(1)
    start = time.perf_counter()
    disagg = DisaggregatedEngine(model, max_model_len=max_len, max_batch_size=16,
                                 prefix_cache_tokens=32768, threads=1)
    started = time.perf_counter() - start
    for _ in range(args.rounds):  # interleaved, so a change in the machine's load hits all
        for threads, name in ((2, names[0]), (1, names[1])):  # the mixed worker's threads
            torch.set_num_threads(threads)
            mixed = LocalEngine(model, max_model_len=max_len, max_batch_size=16)
            await measure(mixed, args, vocab, rows[name])
            await mixed.close()
        torch.set_num_threads(1)
        await measure(disagg, args, vocab, rows[names[2]])
    stats = dict(disagg.stats)
    await disagg.close()
    print(f"model: {'tiny' if args.tiny else 'SmolLM2-135M'} fp32; {args.streams} streams, a "
          f"{args.prompt}-token prompt {args.every} s after the last; {args.rounds} rounds of "
          f"{args.seconds} s per setting, interleaved")
    print(f"{'setting':44} {'ITL p50 ms':>10} {'p90':>7} {'p99':>7} {'max':>7} {'tok/s':>6} "
          f"{'prompts':>7}")
    table = {name: summary(row) for name, row in rows.items()}
    for name, r in table.items():
        print(f"{name:44} {r['p50']:10.1f} {r['p90']:7.1f} {r['p99']:7.1f} {r['max']:7.1f} "
              f"{r['tok_s']:6.1f} {r['prompts']:7d}")
    d = table[names[2]]
    for name in names[:2]:
        m = table[name]
        print(f"disaggregated / {name}: p50 {d['p50'] / m['p50']:.2f}, p90 "
              f"{d['p90'] / m['p90']:.2f}, p99 {d['p99'] / m['p99']:.2f}, tok/s "
              f"{d['tok_s'] / m['tok_s']:.2f}")
    tokens = max(stats["handoff_tokens"], 1)
    print(f"hand-off: {stats['handoffs']} prompts, {stats['handoff_tokens']} tokens, "
          f"{1e6 * stats['handoff_seconds'] / tokens:.1f} us/token, "
          f"{stats['handoff_bytes'] / tokens / 1024:.1f} KiB/token, "
          f"{1e3 * stats['handoff_seconds'] / max(stats['handoffs'], 1):.2f} ms/prompt; prefill "
          f"process {1e6 * stats['prefill_process_seconds'] / tokens:.1f} us/token; stale "
          f"{stats['handoffs_stale']}; decode-side prefill tokens {stats['prefill_tokens']}; "
          f"workers started in {started:.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--tiny", action="store_true")
    asyncio.run(main(parser.parse_args()))
