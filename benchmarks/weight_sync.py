"""Benchmark: full vs delta weight sync (issue 13 item 3) on SmolLM2-135M, in-process.

    python benchmarks/weight_sync.py [--steps 21] [--steps-high 3] [--fp32-steps 5] [--threads 1]
        [--router N] [--ray]

The trainer side is SmolLM2-135M (fp32) taking real AdamW steps (weight decay 0, grad clip 1.0,
as `Trainer`) of a causal-LM loss on a small fixed batch of real text (4 short sentences),
`--steps` steps at lr 1e-6 and `--steps-high` at lr 5e-6, each from the pretrained weights.
After every step the weights are synced with `forgerl.trainer.weight_sync.WeightSync` into
four `LocalEngine`s, one per (dtype, kind): fp32 and bf16 engine copies, each fed by a "full"
and a "delta" sync (the fp32 pair only for the first `--fp32-steps` steps: there every element
changes, the delta is dense and its numbers stay put). With `--router N`, also a bf16/routerN
pair: a `Router` over N bf16 LocalEngines each, every instance fed the same full or delta
payload. The first delta sync is full (no base yet); the delta columns average the later ones.
About 100 s of CPU time; 3-4 min on the shared 2 cores.

Columns: MB = payload bytes / 1e6 in the engine's dtype (tied embedding / lm_head sent once); s
= wall seconds of `WeightSync.sync` (cast, compare + encode + checksums for a delta, hand-off
to the engine's worker thread, apply + checksums there); unchanged = elements whose bits in the
engine's dtype did not change, mean (min) over steps; exact = after the last step the delta
engine's weights (every instance's, behind a router) equal the full engine's bit for bit.
Transport: in-process (the payload is passed by reference); with `--ray`, also a bf16
full/delta pair of engine actors (`forgerl.cluster.RayEngine`, weights through the Ray object
store: `ray.put` + the actor's get + apply) and a bf16/bcast pair whose full syncs are one gloo
broadcast of a packed buffer (`[cluster] weight_transport = "broadcast"`; its deltas still go
through the object store), on a Ray instance this process starts. Ray binds the machine's own
address, so on a machine without a network run it in a private namespace:
`unshare -n sh -c 'ip link set lo up && python benchmarks/weight_sync.py --ray'`. NCCL is not
measured here (no GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from forgerl.cluster import RayEngine, _Broadcast, _Engine
from forgerl.config import load_config
from forgerl.engines.local import LocalEngine
from forgerl.gateway.router import Router
from forgerl.models import load_pretrained
from forgerl.trainer.weight_sync import WeightSync

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank in the morning.",
    "To compute 17 plus 25, add the tens and then the ones: the answer is 42.",
    "Reinforcement learning trains a policy from rewards collected by an agent.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _BenchEngine(_Engine):
    """An engine actor that can also hand back its weights (for the exactness check)."""

    def params(self) -> dict[str, torch.Tensor]:
        return self.engine._params


def ray_engines() -> dict[tuple[str, str], RayEngine]:
    """bf16 "full" and "delta" engine actors on SmolLM2 (Ray started here): through the object
    store (bf16/ray) and with full syncs as a gloo broadcast (bf16/bcast)."""
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=2)
    dump = load_config(None, ["--model.max_model_len", "64", "--rollout.max_tokens", "8",
                              "--engine.max_batch_size", "1",
                              "--engine.prefix_cache_tokens", "0"]).model_dump()
    actor = ray.remote(num_cpus=0)(_BenchEngine)
    engines = {(d, k): RayEngine(actor.remote(dump, "bfloat16"), 64, 1)
               for d in ("bf16/ray", "bf16/bcast") for k in ("full", "delta")}
    for (d, _), engine in engines.items():
        if d == "bf16/bcast":
            _Broadcast([engine], "gloo")
    return engines


async def _params(engine) -> list[dict[str, torch.Tensor]]:
    """The weights each instance of `engine` holds (one dict, or one per Router instance)."""
    if isinstance(engine, Router):
        return [p for e in engine.instances for p in await _params(e)]
    if isinstance(engine, RayEngine):
        return [await engine.actor.params.remote()]
    return [engine._params]


async def run_lr(model, batch: dict, lr: float, steps: int, fp32_steps: int,
                 over_ray: dict, router: int) -> list[dict]:
    """Train `steps` AdamW steps at `lr`, syncing full and delta into bf16 engines (fp32 ones
    for the first `fp32_steps`, Routers over `router` bf16 instances when > 0, and the
    `over_ray` engine actors); one result row per dtype."""
    def local(dtype: torch.dtype) -> LocalEngine:
        return LocalEngine(model, max_model_len=64, max_batch_size=1, prefix_cache_tokens=0,
                           dtype=dtype)

    engines = {(d, k): local(dt) for d, dt in DTYPES.items() for k in ("full", "delta")}
    if router:
        engines |= {(f"bf16/router{router}", k): Router([local(torch.bfloat16)
                                                         for _ in range(router)])
                    for k in ("full", "delta")}
    engines |= over_ray
    syncs = {key: WeightSync(e, key[1]) for key, e in engines.items()}
    records: dict[tuple[str, str], list[dict]] = {key: [] for key in engines}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    try:
        for step in range(1, steps + 1):
            opt.zero_grad()
            model(**batch, labels=batch["input_ids"]).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            weights = {k: v.detach() for k, v in model.state_dict().items()}
            for key, sync in syncs.items():
                if key[0] != "fp32" or step <= fp32_steps:
                    records[key].append(await sync.sync(weights, step))
        rows = []
        for d in dict.fromkeys(k[0] for k in engines):
            full, delta = records[(d, "full")], records[(d, "delta")][1:]
            a = (await _params(engines[(d, "full")]))[0]
            exact = all(torch.equal(a[k].view(-1).view(torch.uint8),
                                    b[k].view(-1).view(torch.uint8))
                        for b in await _params(engines[(d, "delta")]) for k in a)
            unchanged = [1 - r["changed_fraction"] for r in delta]
            rows.append({
                "lr": lr, "dtype": d, "deltas": len(delta), "exact": exact,
                "full_mb": statistics.mean(r["bytes"] for r in full) / 1e6,
                "delta_mb": statistics.mean(r["bytes"] for r in delta) / 1e6,
                "full_s": statistics.median(r["seconds"] for r in full),
                "delta_s": statistics.median(r["seconds"] for r in delta),
                "unchanged": statistics.mean(unchanged), "unchanged_min": min(unchanged),
                "per_step": unchanged,
            })
        return rows
    finally:
        for key, e in engines.items():
            if key not in over_ray:
                await e.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21, help="optimizer steps at lr 1e-6")
    parser.add_argument("--steps-high", type=int, default=3, help="optimizer steps at lr 5e-6")
    parser.add_argument("--fp32-steps", type=int, default=5, help="steps synced in fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--ray", action="store_true", help="also sync bf16 engine actors")
    parser.add_argument("--router", type=int, default=0, metavar="N",
                        help="also sync Routers over N bf16 LocalEngines")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    model, tokenizer = load_pretrained("smollm2")
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    rows = []
    for lr, steps in ((1e-6, args.steps), (5e-6, args.steps_high)):
        model.load_state_dict(initial)
        over_ray = ray_engines() if args.ray else {}
        try:
            rows += asyncio.run(run_lr(model.train(), batch, lr, steps, args.fp32_steps,
                                       over_ray, args.router))
        finally:
            if over_ray:
                import ray

                ray.shutdown()
    where = "in-process LocalEngine" + (f", Routers over {args.router} LocalEngines"
                                        if args.router else "") + (
        " and Ray engine actors (bf16/ray, bf16/bcast)" if args.ray else "")
    print(f"SmolLM2-135M, batch {tuple(batch['input_ids'].shape)}, {where}, "
          f"{args.threads} thread(s), {time.perf_counter() - began:.0f} s in all")
    header = (f"{'lr':>6} {'dtype':>12} {'deltas':>6} {'full MB':>8} {'delta MB':>8} {'bytes':>6} "
              f"{'full s':>6} {'delta s':>7} {'time':>5} {'unchanged':>15} {'exact':>5}")
    print(header)
    for r in rows:
        print(f"{r['lr']:>6.0e} {r['dtype']:>12} {r['deltas']:>6} {r['full_mb']:>8.1f} "
              f"{r['delta_mb']:>8.1f} {r['delta_mb'] / r['full_mb']:>6.3f} {r['full_s']:>6.2f} "
              f"{r['delta_s']:>7.2f} {r['delta_s'] / r['full_s']:>5.1f} "
              f"{100 * r['unchanged']:>6.2f}% ({100 * r['unchanged_min']:.2f}%) "
              f"{'yes' if r['exact'] else 'NO':>5}")
    for r in rows:
        steps = " ".join(f"{100 * u:.2f}" for u in r["per_step"])
        print(f"unchanged % per delta step, lr {r['lr']:.0e} {r['dtype']}: {steps}")
    bf16 = next(r for r in rows if r["lr"] == 1e-6 and r["dtype"] == "bf16")
    ratio = bf16["delta_mb"] / bf16["full_mb"]
    print(f"target bf16 lr 1e-6 delta <= 10% of full bytes: {100 * ratio:.1f}% "
          f"({'met' if ratio <= 0.10 else 'MISSED'}); exact after {bf16['deltas']} deltas: "
          f"{'met' if bf16['exact'] else 'MISSED'}")


if __name__ == "__main__":
    main()
