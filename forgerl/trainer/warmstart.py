"""Supervised warm start on demonstrations: an optional phase before RL (`[warmstart]`).

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

import functools
import json
import random
from pathlib import Path

from forgerl.gateway.errors import GatewayError
from forgerl.gateway.protocols import chat
from forgerl.gateway.renderers.renderer import Renderer
from forgerl.trainer.samples import TrainingSample


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
