"""Benchmark: LoRA (`[model] lora`) vs full fine-tuning on the main job, and how a LoRA policy
reaches the local engine (merged weights vs the adapter through MultiLoRA's hooks).

    python benchmarks/lora_train.py [--steps 2] [--eval-size 8] [--ranks 16 4] [--lora-lr 1e-4]
        [--skip-main-job] [--skip-engine]

Main job: `forgerl train examples/calculator_agent/config.toml` (SmolLM2-135M-Instruct, the
calculator agent) once per variant, back to back, each in its own process, with `--max_steps
STEPS --tasks.eval_size E --tasks.eval_every STEPS --trainer.checkpoint_every STEPS`: full
fine-tuning at the config's lr, then LoRA of each rank (alpha = 2·rank, q/k/v/o) at
`--lora-lr` (LoRA's usual ~10x the full fine-tuning lr). Columns from the run's metrics.jsonl:
trainer seconds per step (`train_seconds`, mean over steps) and its tree tokens per second,
step wall seconds, weight-sync MB and seconds, peak RSS (`peak_rss_gib`, the process's
ru_maxrss), held-out accuracy at step 0 and at STEPS; optimizer-state MB is the size of the
final checkpoint's optimizer.pt (AdamW's exp_avg and exp_avg_sq), trainable the parameters the
optimizer owns.

Engine: SmolLM2 in fp32, a batch of 8 rows decoding 48 tokens after a 32-token prompt with a KV
cache (the local engine's step shape), timed with the base weights (= merged weights: the same
kernels) and with a rank-16 adapter active through MultiLoRA's forward hooks (unmerged); and the
cost of one sync of each: `PolicyAdapter.merged()` + copying it into an engine's weights vs the
adapter's own tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "calculator_agent" / "config.toml"


def job_command(run_dir: Path, extra: list[str], steps: int, eval_size: int) -> list[str]:
    """`forgerl train` of the main job into `run_dir`, STEPS steps, held-out at 0 and STEPS."""
    return [sys.executable, "-m", "forgerl", "train", str(CONFIG), "--run_dir", str(run_dir),
            "--max_steps", str(steps), "--tasks.eval_size", str(eval_size),
            "--tasks.eval_every", str(steps), "--trainer.checkpoint_every", str(steps), *extra]


def job_numbers(name: str, run_dir: Path, steps: int, wall: float) -> dict:
    """A finished main-job run's numbers (its metrics.jsonl and last checkpoint)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train_seconds" in r]
    ckpt = run_dir / "checkpoints" / f"step_{steps:08d}"
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    trainable = sum(s["exp_avg"].numel() for s in opt["state"].values())
    accuracy = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}

    def mean(key: str) -> float:
        return sum(r[key] for r in trained) / len(trained)

    return {"variant": name, "wall_s": wall, "train_s": mean("train_seconds"),
            "train_tok_s": mean("tokens_per_second"), "step_s": mean("step_seconds"),
            "sync_mb": mean("weight_sync_bytes") / 1e6, "sync_s": mean("sync_seconds"),
            "peak_rss_gib": max(r["peak_rss_gib"] for r in records),
            "optimizer_mb": (ckpt / "optimizer.pt").stat().st_size / 1e6,
            "trainable_m": trainable / 1e6, "acc_0": accuracy.get(0, float("nan")),
            "acc_n": accuracy.get(steps, float("nan"))}


def main_jobs(variants: list[tuple[str, list[str]]], steps: int, eval_size: int, out: Path,
              side_by_side: bool) -> list[dict]:
    """Each variant's main-job run, one after another or all at once (`side_by_side`: every
    run sees the same machine load); their numbers."""
    rows, running = [], []
    for name, extra in variants:
        run_dir = out / name.replace(" ", "_")
        proc = subprocess.Popen(job_command(run_dir, extra, steps, eval_size), cwd=ROOT,
                                stdout=subprocess.DEVNULL)
        running.append((name, run_dir, proc, time.perf_counter()))
        if not side_by_side:
            proc.wait()
    ended: dict[str, float] = {}
    while len(ended) < len(running):  # each run's own end, whichever ends first
        for name, _, proc, _ in running:
            if name not in ended and proc.poll() is not None:
                ended[name] = time.perf_counter()
        time.sleep(1)
    for name, run_dir, proc, start in running:
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: forgerl train exited {proc.returncode}")
        rows.append(job_numbers(name, run_dir, steps, ended[name] - start))
    return rows


def engine_costs(rank: int = 16, rows: int = 8, prompt: int = 32, tokens: int = 48) -> dict:
    """Decode seconds with merged (base-speed) weights vs the adapter unmerged, and sync costs."""
    from forgerl.config import LoraConfig
    from forgerl.models import load_pretrained
    from forgerl.trainer.lora import PolicyAdapter

    model, _ = load_pretrained("smollm2")
    model = model.float().eval()
    adapter = PolicyAdapter.wrap(model, LoraConfig(rank=rank, alpha=2 * rank))
    with torch.no_grad():  # a trained adapter: B != 0
        for p in adapter.parameters():
            p.normal_(0, 0.01)
    ids = torch.randint(0, 40000, (rows, prompt), generator=torch.Generator().manual_seed(0))

    def prefill(active: bool) -> tuple[torch.Tensor, object]:
        with torch.no_grad(), adapter.active() if active else contextlib.nullcontext():
            out = model(input_ids=ids, use_cache=True)
        return out.logits[:, -1:].argmax(-1), out.past_key_values

    def step(active: bool, state: tuple[torch.Tensor, object]) -> tuple[float, tuple]:
        start = time.perf_counter()
        with torch.no_grad(), adapter.active() if active else contextlib.nullcontext():
            out = model(input_ids=state[0], past_key_values=state[1], use_cache=True)
        return time.perf_counter() - start, (out.logits[:, -1:].argmax(-1), out.past_key_values)

    states = {False: prefill(False), True: prefill(True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(tokens):  # interleaved step by step: both see the same machine load
        for active in (False, True):
            seconds, states[active] = step(active, states[active])
            times[active].append(seconds)
    engine = {k: v.clone() for k, v in model.state_dict().items()}
    start = time.perf_counter()
    merged = adapter.merged()
    with torch.no_grad():
        for k, v in merged.items():
            engine[k].copy_(v)
    merged_s = time.perf_counter() - start
    start = time.perf_counter()
    copies = [p.detach().clone() for p in adapter.parameters()]
    adapter_s = time.perf_counter() - start
    return {"step_merged_ms": 1e3 * statistics.median(times[False]),
            "step_unmerged_ms": 1e3 * statistics.median(times[True]),
            "sync_merged_mb": sum(v.numel() * 4 for v in merged.values()) / 1e6,
            "sync_merged_s": merged_s,
            "sync_adapter_mb": sum(c.numel() * 4 for c in copies) / 1e6,
            "sync_adapter_s": adapter_s}


def recorded_batches(pool: Path) -> list[list]:
    """The finished rollouts of a main-job run's groups with at least 4 of them, 2 groups per
    batch (tasks_per_step), each group's rewards set to 1, 0, 1, ... (synthetic: a signal for
    every group; the recorded tokens and behavior logprobs are the run's own)."""
    from dataclasses import replace

    from forgerl.datapool.sqlite import SQLitePool

    db = SQLitePool(pool)
    groups = []
    for i in sorted(i for i in db.task_indices() if i >= 0):
        group = db.get_group(i)
        done = [t for t in group.trajectories if t.status == "finished" and t.completions]
        if len(done) >= 4:
            groups.append(replace(group, trajectories=[
                replace(t, reward=float(k % 2 == 0)) for k, t in enumerate(done)]))
    db.close()
    return [groups[i:i + 2] for i in range(0, len(groups) - 1, 2)]


def trainer_child(pool: Path, rank: int, lora_lr: float, steps: int) -> dict:
    """One trainer (full fine-tuning when rank is 0, else LoRA of that rank, alpha = 2·rank) with
    the main job's [trainer] settings, `steps` steps on `recorded_batches(pool)`; its numbers
    (this process: peak RSS, the RSS the model and engine-free trainer held before step 1)."""
    import resource

    from forgerl.config import LoraConfig, load_config
    from forgerl.controller.memory import resident_gib
    from forgerl.models import load_policy
    from forgerl.trainer.data_parallel import build_trainer
    from forgerl.trainer.lora import PolicyAdapter
    from forgerl.weights import unique_tensors

    batches = recorded_batches(pool)[:steps]
    trainer = build_trainer(load_config(CONFIG), load_policy("smollm2")[0])
    if rank:
        trainer.attach_lora(PolicyAdapter.wrap(trainer.model, LoraConfig(
            rank=rank, alpha=2.0 * rank)))
        for group in trainer.optimizer.param_groups:
            group["lr"] = lora_lr
    before = resident_gib()
    seconds, tokens = [], []
    for batch in batches:
        metrics = trainer.train_step(batch)
        seconds.append(metrics["step_seconds"])
        tokens.append(metrics["tokens_after_merge"])
    state = trainer.optimizer.state_dict()["state"].values()
    return {"seconds": seconds, "tokens": tokens, "rss_before_gib": before,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "adamw_mb": sum(v.numel() * v.element_size() for s in state
                            for v in s.values()) / 1e6,
            "trainable_m": sum(p.numel() for g in trainer.optimizer.param_groups
                               for p in g["params"]) / 1e6,
            "sync_mb": sum(v.numel() * v.element_size() for v in unique_tensors(
                trainer.state_dict_for_sync()).values()) / 1e6}


def trainer_steps(pool: Path, ranks: list[int], lora_lr: str, steps: int,
                  rounds: int) -> list[dict]:
    """`trainer_child` of full fine-tuning and each rank, each in its own process (its own
    peak RSS), in turn, `rounds` times (A B C A B C: load drift hits all alike)."""
    runs: dict[int, list[dict]] = {r: [] for r in [0, *ranks]}
    for _ in range(rounds):
        for rank in runs:
            out = subprocess.run([sys.executable, __file__, "--trainer-only", str(pool),
                                  "--child-rank", str(rank), "--lora-lr", lora_lr,
                                  "--steps", str(steps)], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout
            runs[rank].append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for rank, results in runs.items():
        seconds = [x for r in results for x in r["seconds"]]
        tokens = [x for r in results for x in r["tokens"]]
        rows.append({"trainer": f"lora r{rank}" if rank else "full", "steps": len(seconds),
                     "step_s": statistics.median(seconds), "tok_s": sum(tokens) / sum(seconds),
                     "peak_rss_gib": max(r["peak_rss_gib"] for r in results),
                     "rss_before_gib": max(r["rss_before_gib"] for r in results),
                     "adamw_mb": results[0]["adamw_mb"], "trainable_m": results[0]["trainable_m"],
                     "sync_mb": results[0]["sync_mb"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--eval-size", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 4])
    parser.add_argument("--lora-lr", default="1e-4")
    parser.add_argument("--skip-main-job", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--trainer-only", type=Path, metavar="POOL",
                        help="only the interleaved trainer steps on this run's pool.sqlite")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rollout-timeout-s", type=int, help="the main job's rollout.timeout_s "
                        "(its 300 s fails rollouts on a heavily shared machine)")
    parser.add_argument("--out", type=Path, help="keep the main-job runs here (default: a "
                        "new temporary folder, kept)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="start every variant's main-job run at once")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.trainer_only and args.child_rank is not None:
        print(json.dumps(trainer_child(args.trainer_only, args.child_rank, float(args.lora_lr),
                                       args.steps)))
        return
    if args.trainer_only:
        rows = trainer_steps(args.trainer_only, args.ranks, args.lora_lr, args.steps, args.rounds)
        print("| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
        for row in rows:
            print("| " + " | ".join(v if isinstance(v, str) else f"{v:.3g}" for v in row.values())
                  + " |", flush=True)
        return
    if not args.skip_engine:
        e = engine_costs()
        print(f"engine decode step (batch 8, median of 48): merged {e['step_merged_ms']:.1f} ms,"
              f" unmerged adapter {e['step_unmerged_ms']:.1f} ms "
              f"(x{e['step_unmerged_ms'] / e['step_merged_ms']:.3f}); sync: merged "
              f"{e['sync_merged_mb']:.1f} MB in {e['sync_merged_s']:.3f} s, adapter "
              f"{e['sync_adapter_mb']:.1f} MB in {e['sync_adapter_s']:.3f} s", flush=True)
    if args.skip_main_job:
        return
    common = ["--rollout.timeout_s", str(args.rollout_timeout_s)] if args.rollout_timeout_s else []
    variants = [("full", common)] + [
        (f"lora r{r}", [*common, "--model.lora", f"{{rank = {r}, alpha = {2 * r}}}",
                        "--trainer.lr", args.lora_lr]) for r in args.ranks]
    out = args.out or Path(tempfile.mkdtemp(prefix="forgerl-lora-bench-"))
    rows = main_jobs(variants, args.steps, args.eval_size, out, args.side_by_side)
    print("| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(v if isinstance(v, str) else f"{v:.3g}" for v in row.values())
              + " |", flush=True)


if __name__ == "__main__":
    main()
