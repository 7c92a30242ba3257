"""A tool-using verifiers (v1) environment: a calculator toolset (MCP tools), a rubric that
rewards the right final answer and the use of the tool, and rollout state the tools update."""

import random

import verifiers.v1 as vf


class CalcState(vf.State):
    """Rollout state the calculator updates (shared with the task's metrics)."""

    calls: int = 0


class Calculator(vf.Toolset[vf.ToolsetConfig, CalcState]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        self.state.calls += 1
        return a + b

    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        self.state.calls += 1
        return a * b


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcData(vf.TaskData):
    answer: int


class CalcTask(vf.Task[CalcData, CalcState, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [Calculator(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the final reply holds the answer."""
        return float(str(self.data.answer) in trace.last_reply)

    @vf.reward(weight=0.25)
    async def used_calculator(self, trace: vf.Trace) -> float:
        """1.0 when the model called a tool at least once."""
        return float(len(trace.tool_messages) > 0)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(trace.state.calls)


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 30
    seed: int = 0
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            a, b, c = (rng.randint(2, 30) for _ in range(3))
            yield CalcTask(
                CalcData(
                    id=f"calc-{i}",
                    prompt=f"Compute ({a} + {b}) * {c} with the calculator tools, then "
                    "reply with the result.",
                    answer=(a + b) * c,
                ),
                self.config.task,
            )
