"""A single-turn verifiers (v1) environment: add two numbers; two weighted rewards."""

import random

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    """One addition; `answer` is the reference."""

    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        """1.0 when the reply is exactly the sum."""
        return float(trace.last_reply == str(self.data.answer))

    @vf.reward(weight=0.5)
    async def digits_only(self, trace: vf.Trace) -> float:
        """1.0 when the reply is a bare number (the format asked for)."""
        return float(trace.last_reply.isdigit())

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 40
    """How many additions."""
    max_value: int = 50
    """Largest addend."""
    seed: int = 0


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            a, b = rng.randint(1, self.config.max_value), rng.randint(1, self.config.max_value)
            yield ArithTask(
                ArithData(
                    id=f"arith-{i}",
                    prompt=f"What is {a} + {b}? Answer with the number only.",
                    system_prompt="You are a careful calculator.",
                    answer=a + b,
                ),
                self.config.task,
            )
