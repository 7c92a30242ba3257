"""An Open Reward Standard environment written with the protocol's own SDK (`ors-sdk`): sums of
2-3 numbers of 3-4 digits, a `calculate` tool and a `submit` tool.

    calculate(expression) ─► the value; reward 0.1 when the value is the task's answer (a
                             process reward: the sum was computed), else 0.0
    submit(answer)        ─► "correct" / "incorrect"; reward 1.0 / 0.0; finished

Serve it: python examples/ors_calculator/server.py --port 8080 (127.0.0.1), then train with
examples/ors_calculator/config.toml. Splits: "train" (2,000 tasks) and "test" (200 tasks),
generated from fixed seeds (the same on every start).
"""

from __future__ import annotations

import argparse
import ast
import operator
import random

import uvicorn
from ors import Environment, Server, Split, TextBlock, ToolOutput, tool
from pydantic import BaseModel, Field

SIZES = {"train": (2_000, 0), "test": (200, 1)}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv}


def make_tasks(split: str) -> list[dict]:
    size, seed = SIZES[split]
    rng = random.Random(seed)
    tasks = []
    for _ in range(size):
        terms = [rng.randint(100, 9_999) for _ in range(rng.randint(2, 3))]
        question = f"What is {' + '.join(map(str, terms))}?"
        tasks.append({"question": question, "answer": str(sum(terms))})
    return tasks


def evaluate(expression: str) -> float:
    """+, -, *, / and parentheses over numbers; ValueError for anything else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


class CalculateInput(BaseModel):
    expression: str = Field(description="An arithmetic expression, e.g. 123 + 456")


class SubmitInput(BaseModel):
    answer: str = Field(description="The final answer, a number")


class Calculator(Environment):
    """Sums the model cannot do in its head, with a calculator."""

    @classmethod
    def list_splits(cls):
        return [Split(name="train", type="train"), Split(name="test", type="test")]

    @classmethod
    def list_tasks(cls, split: str):
        return make_tasks(split)

    def get_prompt(self):
        return [TextBlock(text=f"{self.task_spec['question']} Use the calculate tool, then "
                               "submit the answer.")]

    @tool
    def calculate(self, params: CalculateInput) -> ToolOutput:
        """Evaluate an arithmetic expression."""
        try:
            result = evaluate(params.expression)
        except ValueError as e:
            return ToolOutput(blocks=[TextBlock(text=f"error: {e}")], reward=0.0)
        text = str(int(result)) if float(result).is_integer() else str(result)
        return ToolOutput(blocks=[TextBlock(text=text)],
                          reward=0.1 if text == self.task_spec["answer"] else 0.0)

    @tool
    def submit(self, params: SubmitInput) -> ToolOutput:
        """Submit the final answer; ends the episode."""
        correct = params.answer.strip().replace(",", "") == self.task_spec["answer"]
        return ToolOutput(blocks=[TextBlock(text="correct" if correct else "incorrect")],
                          reward=1.0 if correct else 0.0, finished=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    uvicorn.run(Server([Calculator]).app, host=args.host, port=args.port, log_level="warning",
                access_log=False)
