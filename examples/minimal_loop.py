"""The whole RL loop in one readable file, over ForgeRL's public pieces.

    G rollouts ──openai client──► gateway ──► local engine      (a session key per rollout)
         │                           └──► SQLite pool           (the exact sampled ids, logprobs)
         └── score ──► pool.get_group ──► Trainer (CISPO) ──► engine.update_weights (version+1)

Each step: run G rollouts of one task through the gateway, as a black-box agent would; score
them; train one CISPO step on the group the gateway recorded; sync the weights to the engine;
answer a held-out question greedily. `forgerl train` runs the same loop with a scheduler,
checkpoints and agents as processes (forgerl/controller.py).

    python examples/minimal_loop.py --model tiny --steps 2    # or smollm2 (default), a folder
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from openai import AsyncOpenAI

from forgerl.datapool.sqlite import SQLitePool
from forgerl.engines.local import LocalEngine
from forgerl.gateway.app import Gateway
from forgerl.gateway.renderers.templates import build_renderer
from forgerl.models import build_byte_tokenizer, build_tiny_model, load_pretrained
from forgerl.trainer.trainer import Trainer

TASKS = [(f"What is {a} + {b}? Reply with the number only.", str(a + b))
         for a, b in [(2, 3), (4, 1), (7, 2), (5, 4)]]
HELD_OUT = ("What is 3 + 3? Reply with the number only.", "6")
MAX_TOKENS = 32


def score(reply: str, answer: str) -> float:
    """1 for the exact answer, else half the fraction of digits in the reply: a shaped reward,
    so that even a random model's group has a spread to learn from."""
    if reply.strip() == answer:
        return 1.0
    return 0.5 * sum(c.isdigit() for c in reply) / max(len(reply), 1)


async def rollout(gateway: Gateway, base_url: str, task: tuple[str, str], task_index: int,
                  rollout_index: int, temperature: float) -> float:
    """One black-box episode: a session key, one chat call over HTTP, a scored answer."""
    trajectory_id, api_key = gateway.open_session(task_index, rollout_index,
                                                  seed=1000 * task_index + rollout_index)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    question, answer = task
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS, temperature=temperature)
    await client.close()
    reward = score(reply.choices[0].message.content or "", answer)
    gateway.finish_session(trajectory_id, reward)  # the trajectory is now ready to train on
    return reward


def load_policy(path: str):
    """(model, tokenizer): "tiny" = the random test model, else `load_pretrained(path)`."""
    if path == "tiny":
        return build_tiny_model(), build_byte_tokenizer()
    return load_pretrained(path)


async def main(model: str = "smollm2", steps: int = 2, group_size: int = 4,
               run_dir: Path | None = None) -> list[dict]:
    """Train `steps` steps; returns one record per step (what the printed line shows)."""
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="minimal_loop-"))
    policy, tokenizer = load_policy(model)
    trainer = Trainer(policy, lr=1e-6)  # CISPO (losses.cispo_loss) is the default loss
    engine = LocalEngine(trainer.model, max_model_len=1024)  # its own copy of the weights
    pool = SQLitePool(run_dir / "pool.sqlite")
    gateway = Gateway(build_renderer(tokenizer), engine, pool, model_name="policy")
    server = await gateway.serve("127.0.0.1", 0)  # uvicorn in this event loop, a free port
    history = []
    try:
        for step in range(steps):
            task = TASKS[step % len(TASKS)]
            rewards = await asyncio.gather(*(rollout(gateway, server.base_url, task, step, g, 1.0)
                                             for g in range(group_size)))
            group = pool.get_group(step)  # the token-exact record of what the engine sampled
            metrics = await asyncio.to_thread(trainer.train_step, [group])
            await engine.update_weights(trainer.state_dict_for_sync(), trainer.step)
            # the engine now serves the new policy (a group without a spread takes no step)
            assert engine.weight_version == trainer.step
            held_out = await rollout(gateway, server.base_url, HELD_OUT, -1 - step, 0, 0.0)
            history.append({"step": step + 1, "reward_mean": sum(rewards) / len(rewards),
                            "loss": metrics["loss"], "weight_version": engine.weight_version,
                            "held_out_reward": held_out})
            print("  ".join(f"{k} {v:.4g}" for k, v in history[-1].items()), flush=True)
    finally:
        await server.stop()
        await engine.close()
        pool.close()
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a local HF folder")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--run_dir", type=Path, default=None, help="default: a new temp folder")
    args = parser.parse_args()
    asyncio.run(main(args.model, args.steps, args.group_size, args.run_dir))
