"""Supervised warm start on demonstrations: an optional phase before RL (`[warmstart]`).

`warm_start(services)` runs it from `run` (forgerl/controller/loop.py) until trainer.step =
warmstart.steps; `load_demos` reads the demonstrations when the services start.

Data flow: a JSONL file, one demonstration per line in the OpenAI fine-tuning chat format,
`{"messages": [...], "tools": [...]}` (messages and tool declarations as a Chat Completions
request carries them) → each record rendered by the gateway's renderer (the model's own chat
format) into one `TrainingSample` → per warm-start step, `batch_size` records (`step_records`)
→ `Trainer.supervised_step`: one prefix tree, the token-mean NLL (`losses.nll_loss`), one
optimizer step, which is a weight version like any RL step.

Every assistant message of a record is trained (loss mask 1 on the ids the model samples for
it, its end-of-turn id included) unless it has `"weight": 0` (context only, e.g. worked
examples in a prompt), as in OpenAI's fine-tuning format. A session whose agent rewrote its
history (a context-management action) is one record per branch: record 1 ends with the CM call,
record 2 holds the rewritten history with the earlier replies at weight 0; the prefix tree
trains their shared prefix once. This is the cold start the field uses when the policy never
samples the wanted action on its own, so RL has no success to reinforce (Forge §2.2; DeepSeek-R1
§2.3.1).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.config import ConfigError
from forgerl.controller.memory import release_heap
from forgerl.gateway.errors import GatewayError
from forgerl.gateway.protocols import chat
from forgerl.gateway.renderers.renderer import Renderer
from forgerl.trainer.samples import TrainingSample

if TYPE_CHECKING:
    from forgerl.controller.services import Services


def demo_sample(record: dict, renderer: Renderer) -> TrainingSample:
    """One demonstration record → a sample: input_ids are the rendering of its messages (no
    generation prompt) up to the last trained id, loss_mask 1 on the completion ids of its
    trained assistant messages; advantages 1.0 there (0.0 elsewhere), behavior logprobs 0.0,
    weight versions 0 (there is no behavior policy), temperatures 1.0.

    Raises ValueError when the record is malformed, trains nothing, or the chat format renders
    an earlier turn differently once later turns follow (split such a record into one per
    assistant message).
    """
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError('expected an object with a "messages" list')
    raw = [dict(m) if isinstance(m, dict) else m for m in record["messages"]]
    trained = [i for i, m in enumerate(raw) if isinstance(m, dict) and m.get("role") ==
               "assistant" and m.pop("weight", 1) != 0]
    try:
        messages, tools = chat.messages(raw), chat.tools(record.get("tools") or [])
    except (GatewayError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"not chat messages and tools ({str(e).splitlines()[0]})") from None
    if not trained:
        raise ValueError("no assistant message to train (all have weight 0)")
    ids = renderer.render(messages, tools, add_generation_prompt=False)
    mask = [0] * len(ids)
    for k in trained:
        prompt = renderer.render(messages[:k], tools, add_generation_prompt=True)
        turn = renderer.render(messages[: k + 1], tools, add_generation_prompt=False)
        if ids[: len(turn)] != turn or turn[: len(prompt)] != prompt:
            raise ValueError(f"message {k}: the chat format renders it differently once later "
                             "turns follow; give each assistant message its own record")
        start, span = len(prompt), turn[len(prompt) :]
        if renderer.end_of_turn_id in span:  # the sampled ids end at the end-of-turn id
            span = span[: len(span) - span[::-1].index(renderer.end_of_turn_id)]
        mask[start : start + len(span)] = [1] * len(span)
    n = len(mask) - mask[::-1].index(1)  # nothing after the last trained id enters the loss
    return TrainingSample(ids[:n], mask[:n], [0.0] * n, [float(m) for m in mask[:n]], [0] * n,
                          temperatures=[1.0] * n)


def load_demos(path: str | Path, renderer: Renderer,
               max_tokens: int | None = None) -> list[TrainingSample]:
    """All records of a JSONL demonstration file as samples (`demo_sample`), in file order.
    Blank lines are skipped. Raises ValueError naming the file and line for a bad record, one
    longer than `max_tokens` (the trainer's row budget), an empty file or one that cannot be
    read (e.g. FileNotFoundError's message)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"warmstart.demos: cannot read {path} ({e})") from None
    samples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            samples.append(demo_sample(json.loads(line), renderer))
            if max_tokens is not None and len(samples[-1].input_ids) > max_tokens:
                raise ValueError(f"{len(samples[-1].input_ids)} tokens exceed "
                                 f"trainer.max_row_tokens ({max_tokens})")
        except ValueError as e:  # json.JSONDecodeError too
            raise ValueError(f"warmstart.demos: {path} line {number}: {e}") from None
    if not samples:
        raise ValueError(f"warmstart.demos: {path} has no records")
    return samples


def step_records(num_records: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Indices of the records warm-start step `step` (0-based) trains on: epochs of a seeded
    shuffle, `batch_size` records per step (an epoch's last batch may wrap into the next), the
    same for a given step however often the run resumed."""
    @functools.cache
    def order(epoch: int) -> list[int]:
        shuffled = list(range(num_records))
        random.Random(seed * 1_000_003 + epoch).shuffle(shuffled)
        return shuffled

    return [order(i // num_records)[i % num_records]
            for i in range(step * batch_size, (step + 1) * batch_size)]


async def warm_start(s: Services) -> None:
    """The [warmstart] phase: supervised steps on the demonstrations (after
    `check_warmstart_first` on the run's records) until trainer.step = warmstart.steps
    (resumes mid-phase), each synced to the engine and logged with phase "warmstart"; then a
    held-out evaluation, trainer.lr and cleared AdamW moments for RL, and a checkpoint."""
    ws, trainer, demos = s.config.warmstart, s.trainer, s.demos
    check_warmstart_first(s.logger.records, ws.steps)
    for group in trainer.optimizer.param_groups:
        group["lr"] = ws.lr or s.config.trainer.lr
    while trainer.step < ws.steps:
        picked = step_records(len(demos), trainer.step, ws.batch_size, s.config.seed)
        metrics = await asyncio.to_thread(trainer.supervised_step, [demos[i] for i in picked])
        await s.sync_weights()
        await asyncio.to_thread(release_heap)
        last = trainer.step == ws.steps
        if last:  # RL starts with its own lr and fresh AdamW moments
            metrics |= await s.evaluate()
            trainer.optimizer.state.clear()
            for group in trainer.optimizer.param_groups:
                group["lr"] = s.config.trainer.lr
        s.log(trainer.step, {"phase": "warmstart", "demos": len(demos), **metrics})
        if last or trainer.step % s.config.trainer.checkpoint_every == 0:
            await s.checkpoint()


def check_warmstart_first(records: list[dict[str, Any]], steps: int) -> None:
    """Raise ConfigError when warmstart.steps = `steps` asks for supervised steps after RL steps
    were logged (`records`, a resumed run whose warmstart.steps was raised): warm start comes
    before RL."""
    if rl := [r["step"] for r in records if r["step"] > 0 and r.get("phase") != "warmstart"]:
        raise ConfigError(f"warmstart.steps: {steps} would run supervised steps after RL step "
                          f"{max(rl)}; warm start comes first (at most {min(rl) - 1} here)")
