"""The GPU paths of ForgeRL in one short run, with their numbers as JSON (issues 12, 13, 14).

Run on a lent GPU machine through `scripts/gpu_check.sh` (writes $OUT/gpu_check.json); on a CPU
`python scripts/gpu_check.py --device cpu --tiny --out DIR` runs the same checks on the tiny model
(tests/test_gpu_check.py), so the script is known to work before device time is spent on it.

Model: SmolLM2-135M's architecture (30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49,152)
randomly initialised (the packaged weights are a 100+ MB GGUF, over the device tool's 64 MiB
carry; random weights give the same shapes, costs and numerics checks), or the tiny model.
Checks, each recorded as {"ok": bool, ...numbers} (one failing check does not stop the rest):
- env: torch / transformers versions, device name, bf16 support, AMX on a CPU.
- agreement_fp32 / agreement_bf16: behavior logprobs of 16 seeded rollouts from LocalEngine
  (fp32; bf16 weights and KV) against the trainer's prefix-tree logprobs on the same weights
  (the trainer's attention implementation: FlexAttention on CUDA; bf16 under autocast); max
  and mean |diff| (nats), ok at < 1e-4 (fp32; 2e-3 on CUDA, where TF32 and kernels differ) and
  mean < 0.02 (bf16).
- train_step: Trainer.train_step on those groups (fp32 weights, bf16 autocast on CUDA): seconds,
  tree tokens, peak CUDA memory (bytes), loss finite.
- weight_update: the trained weights into the engine (`update_weights`, version 1), then a
  rollout whose every token carries version 1; seconds of the update.
- throughput: R requests x K tokens at T = 1 through LocalEngine in bf16 (fp32 on CPU):
  completion tokens per second of wall time.
- nccl: a one-rank NCCL (gloo on CPU) process group, all_reduce and broadcast of the model's
  flat weights: seconds and bytes.
- vllm / sglang: whether each imports here (neither is carried: their wheels exceed 64 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model
from forgerl.trainer.attention import attn_implementation, preferred_attn_implementation
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.trainer import Trainer
from forgerl.trainer.tree_forward import forward_logprobs
from forgerl.types import Completion, Group, SamplingParams, Trajectory


def smollm2_shaped(seed: int = 0) -> LlamaForCausalLM:
    """SmolLM2-135M's architecture with random weights, fp32."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` ids sharing their first half (a group's system prompt)."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (length // 2,), generator=g).tolist()
    return [shared + torch.randint(3, vocab, (length - length // 2,), generator=g).tolist()
            for _ in range(n)]


async def rollouts(engine: LocalEngine, batch: list[list[int]], k: int, temperature: float):
    params = [SamplingParams(temperature, max_tokens=k, seed=i) for i in range(len(batch))]
    return await asyncio.gather(*map(engine.generate, batch, params))


def agreement(model, device: torch.device, dtype: torch.dtype, batch, k: int) -> dict:
    """max / mean |behavior - trainer| logprob over the sampled tokens of `batch`."""
    engine = LocalEngine(model, max_model_len=2048, max_batch_size=len(batch), device=str(device),
                         dtype=dtype)
    try:
        outs = asyncio.run(rollouts(engine, batch, k, 0.8))
    finally:
        asyncio.run(engine.close())
    seqs = [p + o.completion_ids for p, o in zip(batch, outs, strict=True)]
    needed = [[t >= len(p) for t in range(len(s))] for p, s in zip(batch, seqs, strict=True)]
    tree = build_tree_batch(seqs, 8192, needed=needed, temperatures=[[0.8] * len(s) for s in seqs])
    trainer_model = model.to(device)
    impl = preferred_attn_implementation(trainer_model, device)
    got: dict[tuple[int, int], float] = {}
    half = dtype != torch.float32
    with torch.no_grad(), attn_implementation(trainer_model, impl), \
            torch.autocast(device.type, dtype=dtype, enabled=half):
        for row in tree.rows:
            lp = forward_logprobs(trainer_model, row, 256)
            for s, t, v in zip(row.sample_idx.tolist(), row.token_idx.tolist(), lp.tolist(),
                               strict=True):
                got[s, t] = v
    diffs = [abs(got[s, len(batch[s]) + j] - b) for s, o in enumerate(outs)
             for j, b in enumerate(o.logprobs)]
    return {"attention": impl, "tokens": len(diffs), "max_abs_diff": max(diffs),
            "mean_abs_diff": sum(diffs) / len(diffs), "outs": outs}


def groups_of(batch: list[list[int]], outs, group_size: int) -> list[Group]:
    """Groups of `group_size` rollouts; reward 1 for an even last token (a learnable signal)."""
    groups = []
    for g in range(len(batch) // group_size):
        trajs = []
        for r in range(group_size):
            i = g * group_size + r
            o = outs[i]
            c = Completion(batch[i], o.completion_ids, o.logprobs, o.weight_versions, 0,
                           o.finish_reason, sampling=SamplingParams(0.8))
            trajs.append(Trajectory(f"t{i}", g, r, [c], reward=float(o.completion_ids[-1] % 2 == 0),
                                    status="finished"))
        groups.append(Group(g, trajs))
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny model (CPU dry run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    build = build_tiny_model if args.tiny else smollm2_shaped
    vocab = 259 if args.tiny else 49152  # build_tiny_model's / SmolLM2's
    half = torch.bfloat16
    results: dict = {"env": {
        "ok": True, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "device": args.device,
        "name": torch.cuda.get_device_name(0) if cuda else platform.processor(),
        "bf16": torch.cuda.is_bf16_supported() if cuda else None,
        "amx": getattr(torch.cpu, "_is_amx_tile_supported", lambda: None)(),
        "model": "tiny" if args.tiny else "smollm2-shaped (random)"}}
    batch = prompts(vocab, 16, 64)
    state: dict = {}

    def check(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            results[name] = {**fn(), "seconds_total": time.perf_counter() - start}
        except Exception as exc:  # record and go on: one failure must not hide the others
            trace = traceback.format_exc()[-2000:]
            results[name] = {"ok": False, "error": repr(exc), "trace": trace}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "trace"}),
              flush=True)

    def fp32() -> dict:
        r = agreement(build(), device, torch.float32, batch, 24)
        state["outs"] = r.pop("outs")
        return {**r, "ok": r["max_abs_diff"] < (2e-3 if cuda else 1e-4)}

    def bf16() -> dict:
        r = agreement(build(), device, half, batch, 24)
        r.pop("outs")
        return {**r, "ok": r["mean_abs_diff"] < 0.02}

    def train() -> dict:
        trainer = Trainer(build(), lr=1e-5, device=args.device,
                          autocast="bfloat16" if cuda else "off")
        state["trainer"] = trainer
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        m = trainer.train_step(groups_of(batch, state["outs"], 8))
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if cuda else None
        return {"ok": bool(torch.isfinite(torch.tensor(m["loss"]))), "step_seconds": seconds,
                "loss": m["loss"], "tree_tokens": m.get("tokens_after_merge"),
                "peak_cuda_bytes": peak, "attention": trainer.attn_implementation}

    def update() -> dict:
        trainer = state["trainer"]
        engine = LocalEngine(build(), max_model_len=2048, max_batch_size=16, device=str(device),
                             dtype=half if cuda else None)

        async def go():
            start = time.perf_counter()
            await engine.update_weights(trainer.state_dict_for_sync(), 1)
            seconds = time.perf_counter() - start
            out = (await rollouts(engine, batch[:2], 16, 1.0))[0]
            await engine.close()
            return seconds, out

        seconds, out = asyncio.run(go())
        return {"ok": set(out.weight_versions) == {1}, "update_seconds": seconds}

    def throughput() -> dict:
        engine = LocalEngine(build(), max_model_len=2048, max_batch_size=args.requests,
                             device=str(device), dtype=half if cuda else None)
        many = prompts(vocab, args.requests, 64)

        async def go():
            await rollouts(engine, many[:2], 4, 1.0)  # warm-up
            start = time.perf_counter()
            outs = await rollouts(engine, many, args.tokens, 1.0)
            seconds = time.perf_counter() - start
            await engine.close()
            return sum(len(o.completion_ids) for o in outs), seconds

        tokens, seconds = asyncio.run(go())
        return {"ok": tokens > 0, "requests": args.requests, "tokens": tokens,
                "seconds": seconds, "tokens_per_second": tokens / seconds,
                "dtype": str(engine.weight_dtype)}

    def nccl() -> dict:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
        try:
            flat = torch.cat([p.detach().flatten() for p in build().parameters()]).to(device)
            start = time.perf_counter()
            dist.all_reduce(flat)
            dist.broadcast(flat, src=0)
            if cuda:
                torch.cuda.synchronize()
            return {"ok": True, "backend": backend, "bytes": flat.numel() * flat.element_size(),
                    "seconds": time.perf_counter() - start}
        finally:
            dist.destroy_process_group()

    def imports(name: str):
        def fn() -> dict:
            try:
                mod = importlib.import_module(name)
            except ImportError as exc:
                return {"ok": False, "installed": False, "error": str(exc)}
            return {"ok": True, "installed": True, "version": getattr(mod, "__version__", "?")}
        return fn

    for name, fn in [("agreement_fp32", fp32), ("agreement_bf16", bf16), ("train_step", train),
                     ("weight_update", update), ("throughput", throughput), ("nccl", nccl),
                     ("vllm", imports("vllm")), ("sglang", imports("sglang"))]:
        check(name, fn)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print("wrote", out / "gpu_check.json")


if __name__ == "__main__":
    main()
