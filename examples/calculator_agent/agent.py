"""A calculator agent for multi-digit arithmetic, written against the plain OpenAI API.

It imports nothing from ForgeRL: any OpenAI-compatible server works (ForgeRL's gateway during
training, vLLM or a hosted API otherwise). It reads the task from `FORGERL_TASK` (JSON) or stdin,
declares one `calculator` tool, and shows the model how to use it with few-shot example turns:
real earlier user / assistant-with-tool_calls / tool / assistant messages in the history, which
the server renders in its own tool format (ForgeRL's gateway: Hermes `<tool_call>` blocks). It
runs the tool calls the model makes (a safe arithmetic evaluator), loops until the model answers
without a tool call or `FORGERL_MAX_TURNS` model calls are used, and prints the answer (the last
number of the model's final reply) as the last stdout line. Logs go to stderr.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY (read by the openai client), OPENAI_MODEL (default
"policy"), FORGERL_MAX_TURNS (model calls per episode, default 3), FORGERL_MAX_TOKENS (per call,
default 64). Argument: `--shots N`, the few-shot examples shown (0-3, default 2).

Run by hand:
    echo '{"question": "What is 1234 + 5678?"}' | python examples/calculator_agent/agent.py
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import sys

from openai import OpenAI

SYSTEM_PROMPT = (
    "You are a math assistant with a calculator. For every arithmetic problem, first call the "
    "calculator tool with the expression, then reply with only the number it returned."
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 1234 + 567"}},
            "required": ["expression"],
        },
    },
}

PREFIX = "State the final answer to the following arithmetic problem: "
# (expression, result): worked examples in the task's own phrasing, shown as earlier turns.
SHOTS = [("4821 + 3907", "8728"), ("652 - 1479 + 3310", "2483"), ("9034 - 7658", "1376")]

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def safe_eval(expression: str) -> float:
    """Value of an arithmetic expression: numbers, + - * /, unary +/-, parentheses only.

    Raises ValueError for anything else (names, calls, powers, very long input).
    """
    if len(expression) > 200:
        raise ValueError("expression too long")

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expression.strip().rstrip("="), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {expression!r}") from exc
    return ev(tree.body)


def run_tool(name: str, arguments: str) -> str:
    """Result text of one tool call (errors are returned to the model as text)."""
    try:
        args = json.loads(arguments or "{}")
        if name != "calculator" or not isinstance(args, dict):
            return f"error: unknown tool {name!r}"
        value = safe_eval(str(args.get("expression", "")))
    except (ValueError, ZeroDivisionError, RecursionError, json.JSONDecodeError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def few_shot_messages(shots: int) -> list[dict]:
    """`shots` worked examples as real earlier turns: user question, assistant tool call,
    tool result, assistant answer (ids "call_ex0", "call_ex1", ...)."""
    messages: list[dict] = []
    for i, (expression, result) in enumerate(SHOTS[:shots]):
        call = {"id": f"call_ex{i}", "type": "function",
                "function": {"name": "calculator",
                             "arguments": json.dumps({"expression": expression})}}
        messages += [
            {"role": "user", "content": f"{PREFIX}{expression} ="},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result},
            {"role": "assistant", "content": result},
        ]
    return messages


def extract_answer(text: str) -> str:
    """The last number in `text` (e.g. "-12", "3.5"), else the text on one line."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return numbers[-1] if numbers else " ".join(text.split())


def read_task() -> dict:
    """The task from FORGERL_TASK, else from stdin (JSON with at least "question")."""
    raw = os.environ.get("FORGERL_TASK") or sys.stdin.read()
    return json.loads(raw)


def solve(client: OpenAI, question: str, model: str, max_turns: int, max_tokens: int,
          shots: int = 2) -> str:
    """Chat until the model replies without tool calls or `max_turns` calls are used up; the
    answer is the last number of that final reply ("" when the turns ran out first)."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT},
                            *few_shot_messages(shots), {"role": "user", "content": question}]
    for _ in range(max_turns):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR], max_tokens=max_tokens
        )
        message = response.choices[0].message
        reply, calls = message.content or "", message.tool_calls or []
        assistant: dict = {"role": "assistant", "content": reply}
        if calls:
            assistant["tool_calls"] = [
                c.model_dump(include={"id", "type", "function"}) for c in calls
            ]
        messages.append(assistant)
        if not calls:
            return extract_answer(reply) if reply.strip() else ""
        for call in calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"tool {call.function.arguments} -> {result}", file=sys.stderr)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def parse_shots(argv: list[str]) -> int:
    """`--shots N` from the command line (default 2); ValueError for anything else."""
    if not argv:
        return 2
    if len(argv) != 2 or argv[0] != "--shots" or not 0 <= int(argv[1]) <= len(SHOTS):
        raise ValueError(f"usage: agent.py [--shots 0..{len(SHOTS)}], got {argv}")
    return int(argv[1])


def main() -> None:
    task = read_task()
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    answer = solve(
        client,
        task["question"],
        model=os.environ.get("OPENAI_MODEL", "policy"),
        max_turns=int(os.environ.get("FORGERL_MAX_TURNS", "3")),
        max_tokens=int(os.environ.get("FORGERL_MAX_TOKENS", "64")),
        shots=parse_shots(sys.argv[1:]),
    )
    print(answer)


if __name__ == "__main__":
    main()
