"""A white-box agent whose context management is an action the model learns (Forge §2.2).

The task asks for two independent results ("Compute A and B."); the calculator takes one
expression per reply and answers with a long report (`REPORT_LINES` trace lines, then
"result: N"). Two reports do not fit in `max_model_len` beside the task and the worked example,
so an agent that keeps everything overflows before it can answer. Three ways to run it
(`make_agent(mode)`):

- "learned": the model is offered the `compact` tool (`forgerl.agents.context`) and the worked
  examples show a compact call that keeps the first result in the summary;
  whether, when and what to compact is the model's action, trained like any other turn (a
  compact call starts a new branch of the trajectory);
- "truncate": the fixed baseline: no CM tools; before each call the oldest turns are dropped
  to the newest `KEEP_MESSAGES` messages (`ManagedContext.truncate_oldest`), which fits;
- "none": no context management; the call that no longer fits is refused by the gateway
  (`context_length_exceeded`) and the episode ends without an answer.

Two more modes split the task into rounds, as a long session with a user would go: "Compute A."
(a call, the long report, the result), "Compute B." (likewise), then "Now reply with both
results, separated by a comma." Each round is one user message. Once the last model call used
more than `COMPACT_AT` tokens (its usage), the harness manages the context before the next round
(as coding agents auto-compact near a full window):

- "summarize": the harness asks the model for the results so far (`SUMMARIZE`); its reply is
  the model's action, trained like any other turn; the old rounds are then replaced by it (the
  next prompt starts a new branch of the trajectory);
- "drop": the fixed baseline of the same schedule: the old rounds are dropped, no summary;
- "forget": no harness trigger: the model is offered `forget_tool_outputs`
  (`forgerl.agents.context`) and the worked sessions call it at the start of each later round,
  which drops the old long reports but keeps the model's own replies (the results); whether it
  forgets is its sampled action, trained like any other turn (the next prompt is a new branch).
  Without a forget call the second report does not fit and the gateway refuses the call.

The answer is the final reply on one line (the task file's verifier reads its last two
numbers). The agent is an async callable for `forgerl.controller.run(config, agent=...)`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import openai

from forgerl.agents.context import ManagedContext, run_tool_loop

SYSTEM_PROMPT = (
    "You are a math assistant with a calculator. Call the calculator once per reply, one "
    "expression at a time. Finally reply with only the two results, separated by a comma."
)
CM_HINT = (" Its reports are long: after reading a result you may call compact with a summary "
           "that keeps the numbers you need.")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate one expression: two integers with + or -. Returns a long report.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string", "description": "1234 + 567"}},
                   "required": ["expression"]}}}
REPORT_LINES = 24
KEEP_MESSAGES = 2  # the truncation baseline keeps the newest call and its report
EXAMPLES = [(("4821 + 3907", 8728), ("9034 - 7658", 1376)),
            (("652 - 1479", -827), ("3310 + 2046", 5356))]
ROUND_MODES = ("summarize", "drop", "forget")
MODES = ("learned", "truncate", "none", *ROUND_MODES)
ROUND_SYSTEM = ("You are a math assistant with a calculator. Call the calculator for every "
                "expression; after its report, reply with only the result.")
FINAL = "Now reply with both results, separated by a comma."
SUMMARIZE = "The context is full. Reply with every result so far, separated by commas."
SUMMARY = "Summary of the earlier conversation: "
FORGET_HINT = (" Its reports are long: before a new calculation, call forget_tool_outputs to drop "
               "the old reports.")
FORGET = frozenset({"forget_tool_outputs"})
ROUND_EXAMPLES = 2  # worked examples in the round modes' history
COMPACT_AT = 1300  # tokens of the last model call after which the harness manages the context


def report(expression: str) -> str:
    """The calculator's long report for `a + b` / `a - b` (an error text otherwise)."""
    match = re.fullmatch(r"\s*(-?\d{1,12})\s*([+-])\s*(-?\d{1,12})\s*=?\s*", expression)
    if not match:
        return f"error: expected 'a + b' or 'a - b', got {expression!r}"
    a, op, b = int(match[1]), match[2], int(match[3])
    lines = [f"trace {i:02d}: checked operand digits and carry chain, status nominal"
             for i in range(REPORT_LINES)]
    return "\n".join([f"calculator report for {expression.strip()}", *lines,
                      f"result: {a + b if op == '+' else a - b}"])


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_ex{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def example_messages(mode: str) -> list[dict]:
    """The worked examples as real earlier turns: two calls each with short reports (the real
    ones are long) and the answer; with mode "learned" a compact call after the first result."""
    messages: list[dict] = []
    for k, ((e1, r1), (e2, r2)) in enumerate(EXAMPLES):
        first = _call(3 * k, "calculator", {"expression": e1})
        second = _call(3 * k + 2, "calculator", {"expression": e2})
        messages += [{"role": "user", "content": f"Compute {e1} and {e2}."},
                     {"role": "assistant", "content": "", "tool_calls": [first]},
                     {"role": "tool", "tool_call_id": first["id"], "content": f"result: {r1}"}]
        if mode == "learned":
            summary = f"{e1} = {r1}"
            compact = _call(3 * k + 1, "compact", {"summary": summary})
            messages += [{"role": "assistant", "content": "", "tool_calls": [compact]},
                         {"role": "tool", "tool_call_id": compact["id"],
                          "content": f"Context compacted. Your summary: {summary}"}]
        messages += [{"role": "assistant", "content": "", "tool_calls": [second]},
                     {"role": "tool", "tool_call_id": second["id"], "content": f"result: {r2}"},
                     {"role": "assistant", "content": f"{r1}, {r2}"}]
    return messages


async def calculator(args: dict) -> str:
    return report(str(args.get("expression", "")))


def rounds(question: str) -> list[str]:
    """The user messages of a round-mode session: "Compute A and B." -> ["Compute A.",
    "Compute B.", FINAL]. Raises ValueError for another question shape."""
    match = re.fullmatch(r"Compute (.+) and (.+)\.", question.strip())
    if not match:
        raise ValueError(f"expected 'Compute A and B.', got {question!r}")
    return [f"Compute {match[1]}.", f"Compute {match[2]}.", FINAL]


def round_examples(mode: str = "summarize") -> list[dict]:
    """The worked examples of the round modes as earlier turns (short reports): each round's
    call, result and reply, then the summary requests and summaries ("summarize", "drop") or
    a forget call at the start of the second round ("forget"), and the final answer."""
    messages: list[dict] = []
    for k, ((e1, r1), (e2, r2)) in enumerate(EXAMPLES[:ROUND_EXAMPLES]):
        summaries = [f"{r1}", f"{r1}, {r2}"]
        prefix, start = "", len(messages)
        for j, (e, r) in enumerate(((e1, r1), (e2, r2))):
            call = _call(4 * k + j, "calculator", {"expression": e})
            messages.append({"role": "user", "content": f"{prefix}Compute {e}."})
            if mode == "forget" and j > 0:  # the tool itself, on this session's messages
                forget = _call(4 * k + 2, "forget_tool_outputs", {})
                messages.append({"role": "assistant", "content": "", "tool_calls": [forget]})
                dropped = ManagedContext([], messages[start:]).apply(forget, {})
                messages.append({"role": "tool", "tool_call_id": forget["id"],
                                 "content": dropped})
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": f"result: {r}"},
                         {"role": "assistant", "content": str(r)}]
            if mode == "forget":
                continue
            messages += [{"role": "user", "content": SUMMARIZE},
                         {"role": "assistant", "content": summaries[j]}]
            prefix = SUMMARY + summaries[j] + "\n"
        messages += [{"role": "user", "content": prefix + FINAL},
                     {"role": "assistant", "content": f"{r1}, {r2}"}]
    return messages


async def run_rounds(client: openai.AsyncOpenAI, ctx: ManagedContext, question: str, mode: str,
                     max_turns: int, max_tokens: int) -> str:
    """One round-mode session ("summarize", "drop" or "forget"); returns the last reply."""
    prefix, reply, texts = "", "", rounds(question)
    for k, text in enumerate(texts):
        ctx.body.append({"role": "user", "content": prefix + text})
        reply = await run_tool_loop(client, "policy", ctx, [CALCULATOR],
                                    {"calculator": calculator}, max_turns, max_tokens,
                                    cm_tools=FORGET if mode == "forget" else frozenset())
        prefix = ""
        if mode == "forget":  # the model manages its context itself
            continue
        if k < len(texts) - 1 and ctx.tokens > COMPACT_AT:  # not after the final round
            if mode == "summarize":
                ctx.body.append({"role": "user", "content": SUMMARIZE})
                out = await client.chat.completions.create(
                    model="policy", messages=ctx.messages, max_tokens=max_tokens,
                    tools=[CALCULATOR])  # the same tools: the request extends the recorded prompt
                prefix = SUMMARY + " ".join((out.choices[0].message.content or "").split()) + "\n"
            ctx.body = []
            ctx.cm_actions[mode] = ctx.cm_actions.get(mode, 0) + 1
    return reply


def make_agent(mode: str, max_turns: int = 5, max_tokens: int = 48,
               client: Callable[..., Any] = openai.AsyncOpenAI,
               ) -> Callable[[dict, str, str], Awaitable[str | None]]:
    """The agent for `mode` (one of MODES): async (task, base_url, api_key) -> the final reply
    on one line ("" when the turns or the context ran out). `max_turns`: model calls per
    episode, per round in the round modes. `client`: builds the OpenAI client (the scripted
    teacher of demos.py replaces it). ValueError for another mode."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")

    async def agent(task: dict, base_url: str, api_key: str) -> str | None:
        if mode in ROUND_MODES:
            system = ROUND_SYSTEM + (FORGET_HINT if mode == "forget" else "")
            head = [{"role": "system", "content": system}, *round_examples(mode)]
        else:
            system = SYSTEM_PROMPT + (CM_HINT if mode == "learned" else "")
            head = [{"role": "system", "content": system}, *example_messages(mode),
                    {"role": "user", "content": task["question"]}]
        ctx = ManagedContext(head)
        async with client(base_url=base_url, api_key=api_key, max_retries=0) as c:
            try:
                if mode in ROUND_MODES:
                    reply = await run_rounds(c, ctx, task["question"], mode, max_turns,
                                             max_tokens)
                else:
                    reply = await run_tool_loop(
                        c, "policy", ctx, [CALCULATOR], {"calculator": calculator}, max_turns,
                        max_tokens, truncate_to=KEEP_MESSAGES if mode == "truncate" else None,
                        cm_tools=frozenset({"compact"} if mode == "learned" else ()))
            except openai.BadRequestError as e:  # context_length_exceeded: no answer
                if e.code != "context_length_exceeded":
                    raise
                return ""
        last = ctx.body[-1] if ctx.body else {}
        answered = last.get("role") == "assistant" and not last.get("tool_calls")
        return " ".join(reply.split()) if answered else ""

    return agent
