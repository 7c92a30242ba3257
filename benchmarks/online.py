"""Online RL from simulated users: reward per promotion, and a poisoned batch of feedback.

A population of users with a hidden preference (replies made of lowercase letters: the score
is their share of the reply's characters, in [0, 1]) talks to `forgerl serve`'s online routes
over HTTP (the openai SDK for the model calls); each round's feedback arrives one round later
(delayed), from the consenting users' sessions and the others alike (the latter count in
metrics only). After each round the background trainer's pass (`OnlineService.step`) runs:
train a candidate, gate it on the held-out prompts (the same hidden preference as verifier),
canary it, promote or roll back. In rounds `poison_round` and the next, every user's feedback
is inverted (1 - score): the candidate trained on it must be caught by the gate.

    python benchmarks/online.py --rounds 14 --poison_round 9     # the tiny model, ~1-2 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from openai import AsyncOpenAI

from forgerl.config import OnlineConfig
from forgerl.models import build_byte_tokenizer, build_tiny_model
from forgerl.online.serve import start_online
from forgerl.online.service import HeldOut

PROMPTS = ["hi", "tell me a story", "what now?", "say something", "hello there", "go on"]
ADMIN = "sk-admin-online"


def preference(text: str) -> float:
    """The hidden preference: the share of lowercase ASCII letters in the reply."""
    return sum("a" <= ch <= "z" for ch in text) / max(len(text), 1)


async def user(http: httpx.AsyncClient, base_url: str, consent: bool, prompt: str,
               seed: int) -> tuple[str, int, float]:
    """One user: open a session, one chat call; (session_id, weight_version, true score)."""
    r = await http.post("/v1/online/sessions", json={"consent": consent})
    r.raise_for_status()
    session = r.json()
    client = AsyncOpenAI(base_url=base_url, api_key=session["api_key"], max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=16,
        temperature=1.0, seed=seed)
    await client.close()
    version, reply = int(raw.headers["x-forgerl-weight-version"]), raw.parse()
    return session["session_id"], version, preference(reply.choices[0].message.content or "")


async def simulate(rounds: int = 14, users: int = 32, poison_round: int | None = 9,
                   run_dir: Path | None = None, lr: float = 1e-2, seed: int = 0,
                   config: OnlineConfig | None = None, model: Any = None) -> dict:
    """Run the population; returns {"rounds": [...], "decisions": [...]} (also printed).
    `model`: the first served policy (default: a new tiny model)."""
    torch.manual_seed(seed)
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="online-"))
    config = config or OnlineConfig(batch_trajectories=24, steps_per_candidate=1,
                                    max_off_policy_steps=4, canary_share=0.25,
                                    canary_min_feedback=6, canary_tolerance=0.02,
                                    held_out_tolerance=0.0)
    held_out = HeldOut([{"question": p} for p in PROMPTS], lambda _task, text: preference(text),
                       max_tokens=16, samples=8, seed=10_000)
    online = await start_online(model or build_tiny_model(), build_byte_tokenizer(), run_dir,
                                config, held_out, ADMIN, lr=lr, max_model_len=256, background=False,
                                device="cpu")
    service, rng = online.service, random.Random(seed)
    http = httpx.AsyncClient(base_url=online.server.base_url.removesuffix("/v1"),
                             headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60,
                             limits=httpx.Limits(max_keepalive_connections=0))
    history, due, poisoned_ids, seen = [], [], set(), {}
    try:
        for r in range(rounds):
            served = service.engine.incumbent.weight_version
            results = await asyncio.gather(*(
                user(http, online.server.base_url, rng.random() < 0.75, rng.choice(PROMPTS),
                     1000 * r + u) for u in range(users)))
            for session_id, _, score in due:  # last round's feedback arrives now
                resp = await http.post("/v1/online/feedback",
                                       json={"session_id": session_id, "score": score})
                resp.raise_for_status()
            poisoned = poison_round is not None and poison_round <= r < poison_round + 2
            due = [(sid, v, 1.0 - s if poisoned else s) for sid, v, s in results]
            poisoned_ids |= {sid for sid, _, _ in results} if poisoned else set()
            true = [s for _, _, s in results]
            for _, version, score in results:  # the version named by x-forgerl-weight-version
                seen.setdefault(version, []).append(score)
            decision = await service.step()
            history.append({"round": r, "served_version": served,
                            "reward_mean": sum(true) / len(true), "poisoned": poisoned,
                            "decision": decision and decision["decision"]})
            print(json.dumps(history[-1]), flush=True)
    finally:
        await http.aclose()
        await online.close()
    for d in service.decisions:
        batch = service.batches.get(d["version"], [])
        d["poisoned_share"] = sum(t.id in poisoned_ids for t in batch) / max(len(batch), 1)
    by_version = {v: {"true_reward_mean": sum(x) / len(x), "sessions": len(x)}
                  for v, x in sorted(seen.items())}
    return {"rounds": history, "decisions": service.decisions, "by_version": by_version,
            "counters": dict(service.counters), "pool": dict(service.pool.counters)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--poison_round", type=int, default=9)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    out = asyncio.run(simulate(args.rounds, args.users, args.poison_round, lr=args.lr))
    for d in out["decisions"]:
        print(json.dumps(d))
    print(json.dumps({"by_version": out["by_version"]}))
    print(json.dumps({"counters": out["counters"], "pool": out["pool"],
                      "seconds": time.perf_counter() - start}))
