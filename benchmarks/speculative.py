"""Speculative decoding with an online-trained MTP drafter: throughput, acceptance over RL steps.

Run: `.venv/bin/python benchmarks/speculative.py [--steps 50] [--k 3]` (one thread, ~2 min);
`--model smollm2 [--k 3] [--warm_steps 30]` for (c) alone (~4 min).

Model for (a), (b): the tiny random Llama with an untied LM head (`build_tiny_model(
head_std=0.25)`), whose next-token distributions are sharp enough for a drafter to learn (the
plain tiny model's are almost flat, so any drafter "accepts" them); 50 RL steps of SmolLM2-135M
would take far beyond the ~3 minute budget on the shared 2-core box.

(a) decode tokens/s, speculation off vs on (k drafts), at batch 1, 4 and 16 (sampled, T = 1,
    64 tokens per row), with the acceptance rate, after the drafter's warm start.
(b) an RL run of --steps steps (8 rollouts of 32 tokens per step on one prompt, reward = share
    of completion tokens below id 60, CISPO, lr 5e-5) that moves the policy: per step the
    acceptance of the drafter trained online (its engine samples the rollouts that are trained)
    and of the same drafter frozen after the warm start (a second engine, same policy weights,
    same seeds), and the step time of a trainer that trains the drafter vs one that does not
    (same batches; their policies stay bitwise equal, tests/engines/test_speculative.py).
(c) SmolLM2-135M-Instruct, fp32, packed weights: a drafter warm-started on 16 of its own
    64-token samples of 8 story prompts, then decode tokens/s off vs on for k = 1..--k at
    batch 1, 4, 16 (each on between two offs, back to back; off = their mean), the acceptance,
    ms per decode step and the acceptance per draft at which speculation would break even at
    that step cost.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time

import torch

from forgerl.drafter import PREFIX, Drafter, policy_samples, warm_start
from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model, load_policy
from forgerl.trainer.trainer import Trainer
from forgerl.types import Group, SamplingParams
from tests.factories import completion, trajectory

PROMPT = [1, 40, 41, 42, 43, 44]


async def decode_rate(model, drafter, k: int, batch: int, tokens: int = 64) -> tuple[float, float]:
    """(tokens/s, acceptance) of `batch` concurrent sampled requests on a fresh engine."""
    engine = LocalEngine(model, max_model_len=512, max_batch_size=16, drafter=drafter,
                         speculative_tokens=k)
    try:
        await engine.generate([2, 3], SamplingParams(max_tokens=4))  # warm-up
        params = [SamplingParams(1.0, max_tokens=tokens, seed=i) for i in range(batch)]
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate([1, 10 + i, 11 + i], p)
                                      for i, p in enumerate(params)))
        rate = sum(len(o.completion_ids) for o in outs) / (time.perf_counter() - start)
        return rate, engine.stats["accepted_tokens"] / max(engine.stats["draft_tokens"], 1)
    finally:
        await engine.close()


TOPICS = ["the sea", "a robot", "winter", "a small town", "bread", "the moon", "a library",
          "bicycles"]


async def smollm2(args: argparse.Namespace) -> None:
    """(c) SmolLM2-135M-Instruct: warm start on its own samples, then decode tokens/s off vs
    on for k = 1..args.k at batch 1, 4, 16 (decode steps only: prefill is the same either way)."""
    model, tokenizer, system = load_policy("smollm2")
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": system},
         {"role": "user", "content": f"Write a short story about {t}."}],
        add_generation_prompt=True, tokenize=False)) for t in TOPICS]
    start = time.perf_counter()
    engine = LocalEngine(model, max_model_len=512, max_batch_size=16)
    try:
        outs = await asyncio.gather(*(engine.generate(prompts[i % 8], SamplingParams(
            1.0, max_tokens=args.warm_tokens, seed=100 + i)) for i in range(16)))
    finally:
        await engine.close()
    samples = [prompts[i % 8][-8:] + o.completion_ids for i, o in enumerate(outs)]
    sampled = time.perf_counter() - start
    drafter = Drafter.for_model(model)
    kls = warm_start(drafter, model, samples, steps=args.warm_steps, lr=3e-3, batch=4)
    print(f"warm start: 16 samples of {args.warm_tokens} tokens in {sampled:.0f} s, "
          f"{args.warm_steps} steps of 4 samples, top-16 KL {kls[0]:.2f} -> {kls[-1]:.2f} in "
          f"{time.perf_counter() - start - sampled:.0f} s")
    print("\n(c) SmolLM2-135M decode (sampled, T = 1, packed weights), off and on back to back\n"
          "| batch | k | off tok/s | on tok/s | on/off | acceptance | ms/step off | ms/step on "
          "| break-even acceptance |\n|---|---|---|---|---|---|---|---|---|")
    for batch in (1, 4, 16):
        tokens = 40 if batch < 16 else 16
        for k in range(1, args.k + 1):
            before = await decode_only(model, None, 0, batch, prompts, tokens)
            on = await decode_only(model, drafter, k, batch, prompts, tokens)
            after = await decode_only(model, None, 0, batch, prompts, tokens)
            off = [(x + y) / 2 for x, y in zip(before, after, strict=True)]  # the box drifts
            print(f"| {batch} | {k} | {off[0]:.1f} | {on[0]:.1f} | {on[0] / off[0]:.2f} | "
                  f"{on[1]:.2f} | {off[2]:.0f} | {on[2]:.0f} | {break_even(on[2] / off[2], k)} |",
                  flush=True)


def break_even(cost: float, k: int) -> str:
    """The acceptance per draft at which a speculative step of `cost` plain steps emits as
    many tokens as it costs: (1 - a^(k+1)) / (1 - a) = cost (bisection); "none" above k + 1."""
    if cost >= k + 1:
        return "none"
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(k + 1)) < cost else (lo, mid)
    return f"{lo:.2f}"


async def decode_only(model, drafter, k, batch, prompts, tokens) -> tuple[float, float, float]:
    """(decode tokens/s: tokens after each row's first / decode seconds, acceptance, ms per
    decode step)."""
    engine = LocalEngine(model, max_model_len=512, max_batch_size=16, drafter=drafter,
                         speculative_tokens=k, prefix_cache_tokens=0, packed_weights=True)
    try:
        outs = await asyncio.gather(*(engine.generate(prompts[i % len(prompts)], SamplingParams(
            1.0, max_tokens=tokens, seed=i)) for i in range(batch)))
        decoded = sum(len(o.completion_ids) - 1 for o in outs)
        s = engine.stats
        return (decoded / s["decode_seconds"], s["accepted_tokens"] / max(s["draft_tokens"], 1),
                1000 * s["decode_seconds"] / s["decode_steps"])
    finally:
        await engine.close()


async def rollouts(engine: LocalEngine, step: int) -> tuple[list, float]:
    """8 seeded rollouts of 32 tokens; (outputs, acceptance of this call)."""
    before = engine.stats["accepted_tokens"], engine.stats["draft_tokens"]
    params = [SamplingParams(1.0, max_tokens=32, seed=1000 * step + i) for i in range(8)]
    outs = await asyncio.gather(*(engine.generate(PROMPT, p) for p in params))
    accepted = engine.stats["accepted_tokens"] - before[0]
    return outs, accepted / max(engine.stats["draft_tokens"] - before[1], 1)


def group(outs) -> Group:
    trajs = [trajectory(f"r{i}", [completion(PROMPT, o.completion_ids, o.logprobs)],
                        reward=sum(t < 60 for t in o.completion_ids) / len(o.completion_ids))
             for i, o in enumerate(outs)]
    return Group(0, trajs)


async def rl_run(policy, drafter, steps: int, k: int) -> list[dict]:
    online = Trainer(copy.deepcopy(policy), lr=5e-5, device="cpu")
    plain = Trainer(copy.deepcopy(policy), lr=5e-5, device="cpu")
    online.attach_drafter(copy.deepcopy(drafter), lr=2e-3, top_k=16)
    live = LocalEngine(policy, max_model_len=256, drafter=drafter, speculative_tokens=k)
    frozen = LocalEngine(policy, max_model_len=256, drafter=drafter, speculative_tokens=k)
    rows = []
    try:
        for step in range(steps):
            outs, acc_online = await rollouts(live, step)
            _, acc_frozen = await rollouts(frozen, step)
            batch = [group(outs)]
            m = online.train_step(batch)
            t_plain = plain.train_step(batch)["step_seconds"]
            rows.append({"step": step, "online": acc_online, "frozen": acc_frozen,
                         "reward": m["reward_mean"], "step_s": m["step_seconds"],
                         "plain_s": t_plain, "trained": m["num_loss_tokens"] > 0})
            weights = online.state_dict_for_sync()
            await live.update_weights(weights, online.step)
            await frozen.update_weights({n: v for n, v in weights.items()
                                         if not n.startswith(PREFIX)}, online.step)
    finally:
        await live.close()
        await frozen.close()
    return rows


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.model == "smollm2":
        return await smollm2(args)
    policy = build_tiny_model(head_std=0.25)
    drafter = Drafter.for_model(policy)
    start = time.perf_counter()
    kls = warm_start(drafter, policy, policy_samples(policy, 16, 48), steps=60)
    print(f"warm start: 60 steps on 16 policy samples, top-16 KL {kls[0]:.3f} -> {kls[-1]:.3f}"
          f" in {time.perf_counter() - start:.1f} s")
    print(f"\n(a) decode tokens/s, k = {args.k} drafts\n| batch | off | on | on/off | acceptance |")
    print("|---|---|---|---|---|")
    for batch in (1, 4, 16):
        off = on = 0.0
        for _ in range(2):  # best of two, off and on back to back (a shared machine)
            off = max(off, (await decode_rate(policy, None, 0, batch))[0])
            rate, acc = await decode_rate(policy, drafter, args.k, batch)
            on = max(on, rate)
        print(f"| {batch} | {off:.0f} | {on:.0f} | {on / off:.2f} | {acc:.3f} |")
    rows = await rl_run(policy, drafter, args.steps, args.k)
    print(f"\n(b) acceptance per RL step ({args.steps} steps)\n"
          "| step | online | frozen | reward | step s (drafter trained) | step s (not) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['online']:.3f} | {r['frozen']:.3f} | {r['reward']:.3f} "
              f"| {r['step_s']:.3f} | {r['plain_s']:.3f} |")
    first, last = rows[:5], rows[-5:]

    def mean(xs, key):
        return sum(x[key] for x in xs) / len(xs)

    print(f"\nfirst 5 steps: online {mean(first, 'online'):.3f}, frozen {mean(first, 'frozen'):.3f}"
          f"; last 5: online {mean(last, 'online'):.3f}, frozen {mean(last, 'frozen'):.3f}")
    trained = [r for r in rows if r["trained"]]  # a group with equal rewards trains nothing
    print(f"mean step seconds over the {len(trained)} steps that trained: with drafter training "
          f"{mean(trained, 'step_s'):.4f}, without {mean(trained, 'plain_s'):.4f} (ratio "
          f"{mean(trained, 'step_s') / mean(trained, 'plain_s'):.2f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--warm_steps", type=int, default=40)
    parser.add_argument("--warm_tokens", type=int, default=64)
    asyncio.run(main(parser.parse_args()))
