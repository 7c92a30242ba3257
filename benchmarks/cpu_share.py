"""The local engine decoding beside a training thread on one CPU, with and without `CpuShare`.

Run: `.venv/bin/python benchmarks/cpu_share.py [--rows 16] [--tokens 96] [--train-tokens 800]`.

SmolLM2-135M fp32 (the packaged model). Four settings, all in this one process and run, each
with a fresh engine where it decodes: the engine alone (`--rows` sampled requests of `--tokens`
tokens, T = 1), the trainer alone (forward + backward + AdamW on a `--train-tokens` row whose
last 5/8 predictions are scored, as in a chain_sum step), then both at once in two threads,
first each with all of torch's threads (what the controller did before `CpuShare`), then with
one `CpuShare`. Prints decode tok/s, seconds per train step, and their ratios to the run
without sharing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import threading
import time

import torch

from forgerl.cpu_share import CpuShare
from forgerl.engines.local import LocalEngine
from forgerl.models import load_pretrained
from forgerl.types import SamplingParams


def train_steps(model, opt, ids: torch.Tensor, stop: threading.Event, share: CpuShare | None,
                times: list[float], threads: int) -> None:
    """Train steps until `stop` (at least one), appending each step's seconds to `times`."""
    torch.set_num_threads(threads)
    keep = torch.arange(ids.shape[1] * 3 // 8, ids.shape[1])
    while True:
        start = time.perf_counter()
        with share.busy("trainer") if share else contextlib.nullcontext():
            logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits[0]
            logprobs = torch.log_softmax(logits.float(), -1).gather(1, ids[0, keep, None])
            logprobs.sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if stop.is_set():
            return


async def setting(name: str, args, model, trained, opt, ids, gen: bool, train: bool,
                  share: CpuShare | None) -> tuple[float, float]:
    """(decode tok/s, median s per train step) of one setting (0 where that part is off): the
    engine serves `model`, the trainer thread trains `trained`."""
    threads = torch.get_num_threads()
    stop, times, rate = threading.Event(), [], 0.0
    if not gen:  # the trainer alone, no engine: two steps, the first one warms up
        stop.set()
        for _ in range(2):
            train_steps(trained, opt, ids, stop, None, times, threads)
        times.pop(0)
    else:
        engine = LocalEngine(model, max_model_len=1024, max_batch_size=args.rows,
                             prefix_cache_tokens=0, cpu_share=share)
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))  # warm-up
        worker = threading.Thread(target=train_steps,
                                  args=(trained, opt, ids, stop, share, times, threads))
        if train:
            worker.start()
        prompts = [[1, *range(100 + 7 * i, 200 + 7 * i)] for i in range(args.rows)]
        params = SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=0)
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        rate = sum(len(o.completion_ids) for o in outs) / (time.perf_counter() - start)
        stop.set()
        if train:
            worker.join()
        await engine.close()
        torch.set_num_threads(threads)
    step = statistics.median(times) if times else 0.0
    print(f"  {name}: decode {rate:.1f} tok/s, train {step:.2f} s/step ({len(times)} steps)",
          flush=True)
    return rate, step


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--train-tokens", type=int, default=800)
    args = parser.parse_args()
    model, _ = load_pretrained("smollm2")
    trained = load_pretrained("smollm2")[0].train()
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-7, fused=True)
    torch.manual_seed(0)
    ids = torch.randint(3, 40000, (1, args.train_tokens))
    print(f"torch threads {torch.get_num_threads()}; {args.rows} rows x {args.tokens} tokens; "
          f"train rows of {args.train_tokens} tokens")
    common = (args, model, trained, opt, ids)
    alone_gen, _ = await setting("engine alone", *common, True, False, None)
    _, alone_train = await setting("trainer alone", *common, False, True, None)
    base = await setting("both, all threads each", *common, True, True, None)
    shared = await setting("both, CpuShare", *common, True, True, CpuShare())
    print("\n| setting | decode tok/s | train s/step | decode vs all-threads | "
          "train s/step vs all-threads |")
    print("|---|---|---|---|---|")
    print(f"| engine alone | {alone_gen:.1f} | - | | |")
    print(f"| trainer alone | - | {alone_train:.2f} | | |")
    for name, (gen, train) in (("both, all threads each", base), ("both, CpuShare", shared)):
        print(f"| {name} | {gen:.1f} | {train:.2f} | {gen / base[0]:.2f}x | "
              f"{train / base[1]:.2f}x |")


if __name__ == "__main__":
    asyncio.run(main())
