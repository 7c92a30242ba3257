"""A calculator agent for reasoning-gym chain_sum, written against the plain OpenAI API.

It imports nothing from ForgeRL: any OpenAI-compatible server works (ForgeRL's gateway during
training, vLLM or a hosted API otherwise). It reads the task from `FORGERL_TASK` (JSON) or stdin,
asks the model with one `calculator` tool, runs the tool calls it makes (a safe arithmetic
evaluator), and prints its final answer as the last stdout line (the number in the model's final
reply when there is one). Logs go to stderr.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY (read by the openai client), OPENAI_MODEL (default
"policy"), FORGERL_MAX_TURNS (model calls per episode, default 3), FORGERL_MAX_TOKENS (per call,
default 128).

Run by hand:  echo '{"question": "What is 12 + 7?"}' | python examples/chain_sum/agent.py
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
    "You are a careful math assistant. Use the calculator tool to compute arithmetic. "
    "When you have the result, reply with only the final number."
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 + 7 - 3"}},
            "required": ["expression"],
        },
    },
}

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
        tree = ast.parse(expression.strip(), mode="eval")
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


def extract_answer(text: str) -> str:
    """The last number in `text` (e.g. "-12", "3.5"), else the text on one line."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return numbers[-1] if numbers else " ".join(text.split())


def read_task() -> dict:
    """The task from FORGERL_TASK, else from stdin (JSON with at least "question")."""
    raw = os.environ.get("FORGERL_TASK") or sys.stdin.read()
    return json.loads(raw)


def solve(client: OpenAI, question: str, model: str, max_turns: int, max_tokens: int) -> str:
    """Chat until the model replies without tool calls or `max_turns` calls are used up."""
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    reply = ""
    for _ in range(max_turns):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR], max_tokens=max_tokens
        )
        message = response.choices[0].message
        reply = message.content or ""
        calls = message.tool_calls or []
        assistant: dict = {"role": "assistant", "content": reply}
        if calls:
            assistant["tool_calls"] = [
                c.model_dump(include={"id", "type", "function"}) for c in calls
            ]
        messages.append(assistant)
        if not calls:
            break
        for call in calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"tool {call.function.arguments} -> {result}", file=sys.stderr)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return extract_answer(reply) if reply.strip() else ""


def main() -> None:
    task = read_task()
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    answer = solve(
        client,
        task["question"],
        model=os.environ.get("OPENAI_MODEL", "policy"),
        max_turns=int(os.environ.get("FORGERL_MAX_TURNS", "3")),
        max_tokens=int(os.environ.get("FORGERL_MAX_TOKENS", "128")),
    )
    print(answer)


if __name__ == "__main__":
    main()
