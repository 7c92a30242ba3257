"""Context management as an agent action (issue 11 item 3; `forgerl/agents/context.py`).

A white-box agent loop over the real gateway (scripted engine, the official AsyncOpenAI client):
turn 1 calls `lookup`, turn 2 calls `compact` with a summary, turn 3 answers. The compact call
rewrites the history, so turn 3 starts a new trace (a prefix miss: same opening): two
training samples that share the head
(system + task), merged by the prefix tree; the CM turn is trained (loss mask 1 on its sampled
ids, with its turn's advantage) in the first sample and is context in the second.
"""

from __future__ import annotations

import asyncio
import json

import openai

from forgerl.agents.context import CM_TOOLS, DROPPED, ManagedContext, run_tool_loop
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.trainer.advantages import trajectory_advantages
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.samples import trajectory_to_samples_with_stats

from .conftest import ScriptedEngine, render, reply

LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}}}}


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_a_compact_call_starts_a_branch_that_shares_the_head(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    script = [reply(r, _call("lookup", {"key": "x"})),
              reply(r, _call("compact", {"summary": "x is 7"})), reply(r, "7")]
    srv = serve(ScriptedEngine(script), tokenizer)
    tid, key = srv.session()
    head = [{"role": "system", "content": "Find x."}, {"role": "user", "content": "What is x?"}]
    ctx = ManagedContext(head)

    async def lookup(args: dict) -> str:
        return "x = 7"

    async def agent() -> str:
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0) as c:
            return await run_tool_loop(c, "tiny", ctx, [LOOKUP], {"lookup": lookup},
                                       max_turns=4, max_tokens=256)

    assert asyncio.run(agent()) == "7"
    assert ctx.cm_actions == {"compact": 1}
    assert [m["role"] for m in ctx.messages] == ["system", "user", "assistant", "tool",
                                                 "assistant"]
    assert ctx.messages[3]["content"] == "Context compacted. Your summary: x is 7"
    srv.pool.finish_trajectory(tid, "finished", reward=1.0)
    traj = srv.pool.get_trajectory(tid)
    assert [c.completion_ids for c in traj.completions] == [s.ids for s in script]
    assert srv.gateway.counters["prefix_misses"] == 1  # turn 3 did not extend turn 2

    other = srv.pool.get_trajectory(srv.session(task_index=0)[0])
    other.completions, other.reward, other.status = traj.completions[:1], 0.0, "finished"
    advs = trajectory_advantages([traj, other])
    assert advs[0] == [0.5, 0.5, 0.5]  # outcome-only: every turn, the CM turn too
    samples, stats = trajectory_to_samples_with_stats(traj, advs[0])
    assert [c.trace for c in traj.completions] == [0, 0, 1]  # turn 3 extends no turn
    assert (len(samples), stats.extensions, stats.branches) == (2, 1, 0)
    first, second = samples
    cm = traj.completions[1]
    at = len(cm.prompt_ids)
    assert first.input_ids[at:] == cm.completion_ids  # the CM turn ends the first branch...
    assert first.loss_mask[at:] == [1] * len(cm.completion_ids)  # ...and is trained there
    assert set(first.advantages[at:]) == {0.5}
    assert second.input_ids == traj.completions[2].prompt_ids + traj.completions[2].completion_ids
    head_ids = render(r, head, [LOOKUP, *CM_TOOLS], add_generation_prompt=False)
    assert first.input_ids[: len(head_ids)] == second.input_ids[: len(head_ids)] == head_ids
    common = next(i for i, (a, b) in enumerate(zip(first.input_ids, second.input_ids,
                                                    strict=False)) if a != b)
    assert common >= len(head_ids)
    tree = build_tree_batch([first.input_ids, second.input_ids], 4096)
    assert tree.num_tree_tokens == len(first.input_ids) + len(second.input_ids) - common


def test_forget_and_the_truncation_baseline_rewrite_only_the_body():
    ctx = ManagedContext([{"role": "user", "content": "task"}])
    for i in range(3):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "lookup",
                                                                "arguments": "{}"}}
        ctx.body += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": f"page {i}"}]
    forget = {"id": "f", "type": "function",
              "function": {"name": "forget_tool_outputs", "arguments": "{}"}}
    ctx.body.append({"role": "assistant", "content": "", "tool_calls": [forget]})
    assert ctx.apply(forget, {}) == "Dropped 2 tool outputs."  # keeps the page it just read
    assert [m["content"] for m in ctx.body if m["role"] == "tool"] == [DROPPED, DROPPED, "page 2"]
    ctx.body += [{"role": "tool", "tool_call_id": "f", "content": "Dropped 2 tool outputs."},
                 {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"},
                 {"role": "assistant", "content": "", "tool_calls": [forget]}]
    assert ctx.apply(forget, {}) == "Dropped 2 tool outputs."  # after a reply: all earlier
    assert [m["content"] for m in ctx.body if m["role"] == "tool"] == [DROPPED] * 4
    del ctx.body[-5:]
    ctx.truncate_oldest(3)  # keeps the last assistant + tool pair, never an orphaned result
    assert [m["role"] for m in ctx.body] == ["assistant", "tool"]
    assert ctx.head == [{"role": "user", "content": "task"}]
    assert {t["function"]["name"] for t in CM_TOOLS} == {"compact", "forget_tool_outputs"}
