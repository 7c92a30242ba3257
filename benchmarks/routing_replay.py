"""R3 routing replay on the tiny MoE: engine-vs-trainer logprob gaps with and without replay,
and the replay's cost in a training step.

    python benchmarks/routing_replay.py [--rollouts 24] [--tokens 96] [--repeats 5]

One run: the local engine (fp32, prefix cache on) samples `rollouts` completions of `tokens`
tokens at T = 1 from `build_tiny_moe(router_std=0.002)` (near-tied router logits) and records
their routed experts. The trainer scores them on the prefix tree with a copy whose router
weights are scaled elementwise by 1 + eps·N(0, 1) (eps 0: the same weights), everything else
identical, and, as a second setting, the engine re-samples in bfloat16 against the fp32 trainer.
Per setting: routes that differ (token-layers whose expert set the trainer's own router picks
differently from the record), max |engine - trainer| logprob and mean / max |ratio - 1| over
the completion tokens, without and with replay. Then the step time: forward + backward over the
same packed batch (`Trainer.accumulate_gradients`), replay off and on alternately, median of
`repeats` each; and the engine's cost of recording: the same rollouts generated with the router
hooks removed and with them, alternately, median of `repeats`. One intra-op thread
(`torch.set_num_threads(1)`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time

import torch

from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_moe, router_modules
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.routing_replay import replay_routes, routes_tensor
from forgerl.trainer.samples import TrainingSample
from forgerl.trainer.trainer import Trainer
from forgerl.trainer.tree_forward import forward_logprobs
from forgerl.types import SamplingParams

PROMPT = [1, 40, 41, 42, 43, 44, 9]


def sample(model: torch.nn.Module, n: int, tokens: int, dtype: torch.dtype) -> list:
    """(sequences, outputs) of n seeded completions, prompts sharing their first 7 tokens."""
    async def run():
        engine = LocalEngine(model, max_model_len=1024, device="cpu", dtype=dtype)
        try:
            return await asyncio.gather(*[engine.generate(
                [*PROMPT, 50 + i], SamplingParams(temperature=1.0, max_tokens=tokens, seed=i))
                for i in range(n)])
        finally:
            await engine.close()

    outs = asyncio.run(run())
    return [[*PROMPT, 50 + i, *o.completion_ids] for i, o in enumerate(outs)], outs


def perturbed(model: torch.nn.Module, eps: float) -> torch.nn.Module:
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in router_modules(out):
            router.weight.mul_(1 + eps * torch.randn(router.weight.shape, generator=gen))
    return out


@torch.no_grad()
def flipped(model: torch.nn.Module, seqs: list, recorded: list) -> int:
    """Token-layers where `model`'s own expert set differs from the recorded one."""
    n, got = 0, []
    hooks = [r.register_forward_hook(lambda m, a, o: got.append(o[2]))
             for r in router_modules(model)]
    for seq, rec in zip(seqs, recorded, strict=True):
        got.clear()
        model(input_ids=torch.tensor([seq[:-1]]))
        n += int((torch.stack(got, 1).sort(-1).values != rec.sort(-1).values).any(-1).sum())
    for hook in hooks:
        hook.remove()
    return n


@torch.no_grad()
def logprobs(model: torch.nn.Module, seqs: list, routes: list | None) -> torch.Tensor:
    needed = [[t > len(PROMPT) for t in range(len(s))] for s in seqs]
    out = []
    for row in build_tree_batch(seqs, 8192, needed=needed, routes=routes).rows:
        with replay_routes(model, row.routes):
            out.append(forward_logprobs(model, row))
    return torch.cat(out)


def gaps(model, seqs, outs) -> list[float]:
    """[max |Δ|, mean |r - 1|, max |r - 1|] without replay, then with."""
    behavior = torch.tensor([x for o in outs for x in o.logprobs])
    row = []
    for routes in (None, [routes_tensor(o.routed_experts) for o in outs]):
        delta = logprobs(model, seqs, routes) - behavior
        ratio = (delta.exp() - 1).abs()
        row += [delta.abs().max().item(), ratio.mean().item(), ratio.max().item()]
    return row


def step_times(model, seqs, outs, repeats: int) -> tuple[float, float]:
    """Median seconds of forward + backward over the packed batch, replay off and on."""
    p = len(PROMPT) + 1
    samples = [TrainingSample(
        s, [0] * p + [1] * len(o.completion_ids), [0.0] * p + o.logprobs,
        [0.0] * p + [0.5 - i % 2] * len(o.completion_ids), [-1] * p + o.weight_versions,
        temperatures=[1.0] * len(s), routes=o.routed_experts)
        for i, (s, o) in enumerate(zip(seqs, outs, strict=True))]
    trainer = Trainer(copy.deepcopy(model), device="cpu")
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for replay in (False, True):
            trainer.routing_replay = replay
            start = time.perf_counter()
            trainer.accumulate_gradients(trainer.pack(samples, {}))
            times[replay].append(time.perf_counter() - start)
            trainer.optimizer.zero_grad(set_to_none=True)
    return statistics.median(times[False]), statistics.median(times[True])


def engine_seconds(model: torch.nn.Module, n: int, tokens: int, repeats: int
                   ) -> tuple[float, float]:
    """Median wall seconds of n concurrent seeded completions on the local engine, without
    route recording (its router hooks removed) and with it, alternately."""
    times: dict[bool, list[float]] = {False: [], True: []}

    async def once(record: bool) -> float:
        engine = LocalEngine(model, max_model_len=1024, device="cpu", prefix_cache_tokens=0)
        if not record:
            for router in router_modules(engine.model):
                router._forward_hooks.clear()
            engine.recorder = None
        start = time.perf_counter()
        await asyncio.gather(*[engine.generate([*PROMPT, 50 + i], SamplingParams(
            temperature=1.0, max_tokens=tokens, seed=i)) for i in range(n)])
        seconds = time.perf_counter() - start
        await engine.close()
        return seconds

    for _ in range(repeats):
        for record in (False, True):
            times[record].append(asyncio.run(once(record)))
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_moe(router_std=0.002)
    seqs, outs = sample(model, args.rollouts, args.tokens, torch.float32)
    recorded = [routes_tensor(o.routed_experts) for o in outs]
    cells = sum(r.shape[0] * r.shape[1] for r in recorded)
    tokens = sum(len(o.completion_ids) for o in outs)
    print(f"{args.rollouts} rollouts, {tokens} completion tokens, {cells} token-layers routed")
    print("| setting | routes flipped | max abs dlogprob: no replay | replay "
          "| mean / max abs(ratio-1): no replay | replay |")
    print("|---|---|---|---|---|---|")
    for eps in (0.0, 1e-3, 3e-3, 1e-2):
        trainer_model = perturbed(model, eps)
        g = gaps(trainer_model, seqs, outs)
        print(f"| router x (1 + {eps:g} N) | {flipped(trainer_model, seqs, recorded)} | "
              f"{g[0]:.2e} | {g[3]:.2e} | {g[1]:.2e} / {g[2]:.2e} | {g[4]:.2e} / {g[5]:.2e} |")
    bseqs, bouts = sample(model, args.rollouts, args.tokens, torch.bfloat16)
    g = gaps(model, bseqs, bouts)
    brec = [routes_tensor(o.routed_experts) for o in bouts]
    print(f"| bf16 engine, fp32 trainer | {flipped(model, bseqs, brec)} | {g[0]:.2e} | "
          f"{g[3]:.2e} | {g[1]:.2e} / {g[2]:.2e} | {g[4]:.2e} / {g[5]:.2e} |")
    off, on = step_times(perturbed(model, 3e-3), seqs, outs, args.repeats)
    print(f"\nforward+backward of the batch: replay off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms"
          f" (x{on / off:.3f})")
    off, on = engine_seconds(model, args.rollouts, args.tokens, args.repeats)
    print(f"engine, {args.rollouts} x {args.tokens} tokens: recording off {off:.2f} s, on "
          f"{on:.2f} s (x{on / off:.3f})")


if __name__ == "__main__":
    main()
