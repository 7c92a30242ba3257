"""Benchmark: peak memory and step time of one packed row's forward+backward (issue 14).

    python benchmarks/memory.py [--sizes 1024 2048 4096] [--chunk 512] [--threads 1]
                                [--cap-gib 9] [--model smollm2|tiny]

One packed prefix-tree row of N tokens: a 128-token prompt and N - 128 trained completion
tokens (one long trajectory, so every completion position needs its logits), at temperature
0.8. Loss = -mean policy logprob over the trained tokens, as the trainer's CISPO loss at ratio 1
up to a constant. Methods, each measured in a fresh worker process so peaks never mix:
- baseline: `forward_logprobs(chunk_tokens=0)`, the model's own forward with logits_to_keep
  (holds (K, V) logits, scaled logits and log-probs, and their gradients);
- chunked: `forward_logprobs(chunk_tokens=--chunk)`: hidden states, then lm_head + log_softmax
  per chunk under checkpoint;
- chunked+ckpt: chunked plus full activation checkpointing (`set_activation_checkpointing`).

Peak memory is the peak RSS (the kernel's VmHWM, reset through /proc/self/clear_refs after the
model and the row are built) minus the RSS at that moment: what one forward+backward adds,
including gradients (allocated on first backward), on CPU. torch's CPU allocator keeps no peak
statistics and tracemalloc does not see torch, so RSS it is. Time is the wall time of that one
pass (no warm-up: a warm-up would raise the high-water mark first). The parent kills a worker
whose RSS passes --cap-gib, or when the machine's MemAvailable falls under --min-free-gib
(other jobs share it), and reports it as over the cap; with --start-free-gib it first waits
(up to --wait-s) for that much MemAvailable before starting each worker. The slope is the
least-squares KiB per token of peak memory over the sizes measured.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("baseline", "chunked", "chunked+ckpt")
PROMPT_TOKENS = 128


def _status_kib(field: str, pid: int | str = "self") -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


def _meminfo_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))


def worker(size: int, method: str, chunk: int, threads: int, model_name: str) -> dict:
    """One forward+backward of a `size`-token row by `method`; peak RSS delta and seconds."""
    import torch

    from forgerl.models import build_tiny_model, load_policy
    from forgerl.trainer.attention import attn_implementation
    from forgerl.trainer.prefix_tree import build_tree_batch
    from forgerl.trainer.trainer import set_activation_checkpointing
    from forgerl.trainer.tree_forward import forward_logprobs

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_tiny_model() if model_name == "tiny" else load_policy("smollm2")[0]
    model.train()
    vocab = model.get_input_embeddings().num_embeddings
    set_activation_checkpointing(model, "full" if method == "chunked+ckpt" else "off", 1)
    seq = torch.randint(3, vocab, (size,)).tolist()
    needed = [[t >= PROMPT_TOKENS for t in range(size)]]
    (row,) = build_tree_batch([seq], size, needed=needed, temperatures=[[0.8] * size]).rows
    chunk_tokens = 0 if method == "baseline" else chunk
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to now
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    with attn_implementation(model, "sdpa"):
        logprobs = forward_logprobs(model, row, chunk_tokens)  # (K,)
    (-logprobs.mean()).backward()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    return {"size": size, "method": method, "peak_mib": (peak - before) / 1024,
            "seconds": seconds, "logprob_sum": logprobs.sum().item()}


def run_worker(args: argparse.Namespace, size: int, method: str) -> dict:
    """Run `worker` in a fresh process; kill it if its RSS passes the cap."""
    cmd = [sys.executable, __file__, "--worker", str(size), method, "--chunk", str(args.chunk),
           "--threads", str(args.threads), "--model", args.model]
    deadline = time.monotonic() + args.wait_s  # let other jobs on the machine free memory first
    while (_meminfo_kib("MemAvailable") < args.start_free_gib * 1024 * 1024
           and time.monotonic() < deadline):
        time.sleep(2)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    cap_kib = args.cap_gib * 1024 * 1024
    while proc.poll() is None:
        try:
            over = _status_kib("VmRSS", proc.pid) > cap_kib
        except (FileNotFoundError, AttributeError):
            over = False
        low = _meminfo_kib("MemAvailable") < args.min_free_gib * 1024 * 1024
        if over or low:  # never push the shared machine (and its other jobs) out of memory
            proc.kill()
            proc.wait()
            return {"size": size, "method": method, "over_cap": True}
        time.sleep(0.2)
    out = proc.stdout.read().strip().splitlines()
    if proc.returncode != 0 or not out:
        return {"size": size, "method": method, "failed": proc.returncode}
    return json.loads(out[-1])


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope (y per x) of (x, y) points; nan with fewer than two."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cap-gib", type=float, default=9.0)
    parser.add_argument("--min-free-gib", type=float, default=1.0)
    parser.add_argument("--start-free-gib", type=float, default=0.0)
    parser.add_argument("--wait-s", type=float, default=600.0)
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    parser.add_argument("--worker", nargs=2, metavar=("SIZE", "METHOD"))
    args = parser.parse_args()
    if args.worker:
        size, method = int(args.worker[0]), args.worker[1]
        print(json.dumps(worker(size, method, args.chunk, args.threads, args.model)))
        return
    results: dict[tuple[int, str], dict] = {}
    for size in args.sizes:
        for method in args.methods:
            r = results[size, method] = run_worker(args, size, method)
            print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"\nSmolLM2-135M fp32 ({args.model}), one packed row, {args.threads} thread(s), "
          f"chunk {args.chunk}; peak = VmHWM - RSS before the pass (MiB)")
    header = f"{'tokens':>7} | " + " | ".join(f"{m:>24}" for m in args.methods)
    print(header + " | " + " | ".join(f"{m} / baseline" for m in args.methods[1:]))
    print("-" * len(header))
    for size in args.sizes:
        cells, ratios = [], []
        base = results.get((size, "baseline"), {})
        for method in args.methods:
            r = results[size, method]
            if "peak_mib" not in r:
                cells.append(f"{'over cap' if r.get('over_cap') else 'failed':>24}")
            else:
                cells.append(f"{r['peak_mib']:>9.0f} MiB {r['seconds']:>8.1f} s")
            if method == "baseline":
                continue
            if "peak_mib" in r and "peak_mib" in base:
                ratios.append(f"{r['peak_mib'] / base['peak_mib']:.2f}x mem "
                              f"{r['seconds'] / base['seconds']:.2f}x time")
            else:
                ratios.append("-")
        print(f"{size:>7} | " + " | ".join(cells) + " | " + " | ".join(ratios))
    for method in args.methods:
        pts = [(s, results[s, method]["peak_mib"]) for s in args.sizes
               if "peak_mib" in results[s, method]]
        print(f"slope {method}: {slope(pts) * 1024:.0f} KiB per token")


if __name__ == "__main__":
    main()
