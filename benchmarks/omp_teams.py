"""One decode step from a second thread, with and without an OpenMP team in the main thread.

Run: `.venv/bin/python benchmarks/omp_teams.py [--rows 32] [--dtype auto]`.

Each setting runs in its own process (libgomp's pools are per process): the packaged SmolLM2
model is loaded in the main thread, either with all of torch's threads (the main thread's pool
gets a worker, as before `cpu_share.single_threaded_caller`) or at one thread, then a second
thread (as the local engine's worker) prefills `--rows` rows of 250 tokens and times 20 decode
steps at all threads. Prints the median step time and the ratio (cpu_share.py explains it:
libgomp's throttled wait once pool workers plus the main thread outnumber the cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time


def worker(main_team: bool, rows: int, dtype: str) -> dict:
    """Median seconds of a decode step run from a second thread."""
    import torch

    from forgerl.engines.local.kv_batch import _KVCache
    from forgerl.models import engine_dtype, load_pretrained

    cores = torch.get_num_threads()
    if not main_team:
        torch.set_num_threads(1)
    model = load_pretrained("smollm2")[0].to(engine_dtype(dtype))
    times: list[float] = []

    def decode() -> None:
        torch.set_num_threads(cores)
        with torch.inference_mode():
            ids = torch.randint(3, 49000, (rows, 250))
            cache, mask = _KVCache(), torch.ones(rows, 250, dtype=torch.long)
            out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True,
                        logits_to_keep=1)
            for step in range(25):
                start = time.perf_counter()
                mask = torch.cat([mask, mask.new_ones(rows, 1)], 1)
                out = model(input_ids=out.logits[:, -1].argmax(-1)[:, None],
                            attention_mask=mask, position_ids=torch.full((rows, 1), 250 + step),
                            cache=cache, use_cache=True)
                times.append(time.perf_counter() - start)

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join()
    return {"seconds": statistics.median(times[5:]), "cores": cores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--worker", choices=("team", "single"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker == "team", args.rows, args.dtype)))
        return
    results = {}
    for setting in ("team", "single"):
        out = subprocess.run([sys.executable, __file__, "--worker", setting, "--rows",
                              str(args.rows), "--dtype", args.dtype],
                             capture_output=True, text=True, check=True)
        results[setting] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["team"]["seconds"]
    print(f"{args.rows} rows x 250 cached tokens, {args.dtype}, "
          f"{results['team']['cores']} threads in the decode thread\n")
    print("| main thread | decode step (ms, median of 20) | vs a main-thread team |")
    print("|---|---|---|")
    for setting, label in (("team", "loaded the model with all threads"),
                           ("single", "one thread (`single_threaded_caller`)")):
        seconds = results[setting]["seconds"]
        print(f"| {label} | {1000 * seconds:.1f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
