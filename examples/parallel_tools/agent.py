"""A calculator agent whose tool takes real time, written against the plain OpenAI API.

Each task asks for two independent results ("Compute A and B."). The calculator answers after
`FORGERL_TOOL_LATENCY_S` seconds (default 2.0: a slow remote tool); the tool calls of one
reply run concurrently, so a reply with both calls costs one latency, one call per reply costs
two plus an extra model call. The few-shot history shows both styles; the
completion-time reward (`[reward] completion_time`) is what can teach the faster one.

It imports nothing from ForgeRL. It reads the task from `FORGERL_TASK` (JSON) or stdin, loops
until the model answers without a tool call or `FORGERL_MAX_TURNS` model calls are used, and
prints the final reply on one line as its last stdout line (the verifier reads its last two
numbers). Logs go to stderr.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY (read by the openai client), OPENAI_MODEL (default
"policy"), FORGERL_MAX_TURNS (default 4), FORGERL_MAX_TOKENS (default 96),
FORGERL_TOOL_LATENCY_S (default 2.0), FORGERL_REMOTE_LATENCY_S (default 15.0). Arguments, one
letter per few-shot example: `--styles XYZ`, "p" (both calls in one reply) or "s" (one call per
reply), default "psp"; `--tools XYZ`, "c" (calculator) or "r" (calculator_remote, a slower tool
with the same answers, declared only when some example uses it), default "ccc".

Run by hand:
    echo '{"question": "Compute 1234 + 5678 and 4321 - 876."}' | python agent.py
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

SYSTEM_PROMPT = (
    "You are a math assistant with a calculator. Call the calculator tool for every "
    "arithmetic expression; you may call it several times in one reply. Then reply with only "
    "the two numbers it returned, separated by a comma."
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate one arithmetic expression: two integers with + or -.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 1234 + 567"}},
            "required": ["expression"],
        },
    },
}
# A second calculator with the same answers, slower (a remote service): declared only when a
# few-shot example uses it (`--tools` letter "r").
REMOTE = {"type": "function", "function": {
    **CALCULATOR["function"], "name": "calculator_remote",
    "description": "Evaluate one arithmetic expression on the remote service: same answers."}}
LATENCY_ENV = {"calculator": ("FORGERL_TOOL_LATENCY_S", "2.0"),
               "calculator_remote": ("FORGERL_REMOTE_LATENCY_S", "15.0")}
TOOL_NAMES = {"c": "calculator", "r": "calculator_remote"}  # `--tools` letters
# Three worked examples; `--styles` says which show both calls in one reply ("p", parallel)
# and which one call per reply ("s", sequential); `--tools` which calculator each one uses
# ("c" calculator, "r" calculator_remote).
SHOTS = [(("4821 + 3907", "8728"), ("9034 - 7658", "1376")),
         (("652 - 1479", "-827"), ("3310 + 2046", "5356")),
         (("7215 + 1388", "8603"), ("5120 - 6494", "-1374"))]


def calculate(expression: str, name: str = "calculator") -> str:
    """`a + b` or `a - b` for integers, after tool `name`'s latency; an error text otherwise."""
    time.sleep(float(os.environ.get(*LATENCY_ENV[name])))
    match = re.fullmatch(r"\s*(-?\d{1,12})\s*([+-])\s*(-?\d{1,12})\s*=?\s*", expression)
    if not match:
        return f"error: expected 'a + b' or 'a - b', got {expression!r}"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b)


def run_tool(name: str, arguments: str) -> str:
    """Result text of one tool call (errors are returned to the model as text)."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: {exc}"
    if name not in LATENCY_ENV or not isinstance(args, dict):
        return f"error: unknown tool {name!r}"
    return calculate(str(args.get("expression", "")), name)


def few_shot_messages(styles: str = "psp", tools: str = "ccc") -> list[dict]:
    """The SHOTS as real earlier turns, in the gateway's own tool format once rendered; shot i
    makes both calls in one reply when styles[i] == "p", one call per reply when it is "s", to
    calculator_remote when tools[i] == "r", else to calculator."""
    messages: list[dict] = []
    for i, ((first, second), style, tool) in enumerate(zip(SHOTS, styles, tools, strict=True)):
        parallel, name = style == "p", TOOL_NAMES[tool]
        calls = [{"id": f"call_ex{i}_{k}", "type": "function",
                  "function": {"name": name,
                               "arguments": json.dumps({"expression": expr})}}
                 for k, (expr, _) in enumerate((first, second))]
        results = [{"role": "tool", "tool_call_id": c["id"], "content": r}
                   for c, (_, r) in zip(calls, (first, second), strict=True)]
        messages.append({"role": "user", "content": f"Compute {first[0]} and {second[0]}."})
        if parallel:
            messages += [{"role": "assistant", "content": "", "tool_calls": calls}, *results]
        else:
            for call, result in zip(calls, results, strict=True):
                messages += [{"role": "assistant", "content": "", "tool_calls": [call]}, result]
        messages.append({"role": "assistant", "content": f"{first[1]}, {second[1]}"})
    return messages


def solve(client: OpenAI, question: str, model: str, max_turns: int, max_tokens: int,
          styles: str = "psp", tools: str = "ccc") -> str:
    """Chat until the model replies without tool calls or `max_turns` calls are used up; the
    final reply on one line ("" when the turns ran out first). Each reply's count of tool calls
    goes to stderr (`reply: N tool calls`)."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT},
                            *few_shot_messages(styles, tools),
                            {"role": "user", "content": question}]
    declared = [CALCULATOR, REMOTE] if "r" in tools else [CALCULATOR]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(max_turns):
            response = client.chat.completions.create(
                model=model, messages=messages, tools=declared, max_tokens=max_tokens)
            message = response.choices[0].message
            reply, calls = message.content or "", message.tool_calls or []
            assistant: dict = {"role": "assistant", "content": reply}
            if calls:
                assistant["tool_calls"] = [c.model_dump(include={"id", "type", "function"})
                                           for c in calls]
            messages.append(assistant)
            print(f"reply: {len(calls)} tool calls", file=sys.stderr)
            if not calls:
                return " ".join(reply.split())
            results = pool.map(lambda c: run_tool(c.function.name, c.function.arguments), calls)
            for call, result in zip(calls, results, strict=True):
                print(f"tool {call.function.name} {call.function.arguments} -> {result}",
                      file=sys.stderr)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def parse_args(argv: list[str]) -> tuple[str, str]:
    """(styles, tools) from `[--styles XYZ] [--tools XYZ]`, one letter per shot: p|s (default
    "psp") and c|r (default "ccc"); ValueError for anything else."""
    opts = {"--styles": "psp", "--tools": "ccc"}
    usage = f"usage: agent.py [--styles {len(SHOTS)} of p|s] [--tools {len(SHOTS)} of c|r]"
    if len(argv) % 2 or set(argv[::2]) - opts.keys():
        raise ValueError(f"{usage}, got {argv}")
    opts |= dict(zip(argv[::2], argv[1::2], strict=True))
    for (key, value), letters in zip(opts.items(), ("ps", "".join(TOOL_NAMES)), strict=True):
        if len(value) != len(SHOTS) or set(value) - set(letters):
            raise ValueError(f"{usage}, got {key} {value!r}")
    return opts["--styles"], opts["--tools"]


def main() -> None:
    raw = os.environ.get("FORGERL_TASK") or sys.stdin.read()
    styles, tools = parse_args(sys.argv[1:])
    answer = solve(OpenAI(), json.loads(raw)["question"],
                   model=os.environ.get("OPENAI_MODEL", "policy"),
                   max_turns=int(os.environ.get("FORGERL_MAX_TURNS", "4")),
                   max_tokens=int(os.environ.get("FORGERL_MAX_TOKENS", "96")),
                   styles=styles, tools=tools)
    print(answer)


if __name__ == "__main__":
    main()
