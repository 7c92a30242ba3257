"""The task-source seam (forgerl/tasks/base.py, agent.py; the controller's episode path) with an
environment written here: tasks from `Environment.tasks`, the built-in tool agent's calls through
the real gateway, per-call rewards as process rewards on the calling turn, the `finished` reward
as the outcome, an unreachable environment as an infrastructure abort, and a training step.
"""

from __future__ import annotations

import json
import os
import re
from typing import ClassVar

import pytest

from forgerl.config import ConfigError, load_config
from forgerl.controller import make_task_sets, run, start_services
from forgerl.tasks import sources
from forgerl.tasks.base import Environment, EnvironmentError, Episode, Step

from ..test_controller import sync, tiny_config
from .conftest import first_batch, one_step, script_policy

pytestmark = pytest.mark.slow


class CounterEpisode(Episode):
    """Reach `target` by add(n) calls: each call rewards 0.1; submit() ends the episode with
    reward 1.0 when the total is the target, else 0.0. `fail` makes every call an
    infrastructure failure (an unreachable server)."""

    def __init__(self, target: int, fail: bool = False) -> None:
        super().__init__(prompt=[{"role": "user", "content": f"Reach {target}."}],
                         tools=[_tool("add", {"n": {"type": "integer"}}), _tool("submit", {})])
        self.target, self.total, self.fail = target, 0, fail
        CounterEnvironment.calls.append(self)
        self.closed = False

    async def call(self, name, arguments):
        if self.fail:
            raise EnvironmentError("connection refused")
        if name == "add":
            self.total += int(arguments.get("n", 0))
            return Step(f"total {self.total}", reward=0.1)
        if name == "submit":
            return Step("submitted", reward=float(self.total == self.target), finished=True)
        return await super().call(name, arguments)

    async def close(self):
        self.closed = True


class CounterEnvironment(Environment):
    standard = "counter"
    calls: ClassVar[list[CounterEpisode]] = []
    started = stopped = 0

    def tasks(self, split, size, seed):
        base = 100 if split == "eval" else 0
        return [{"question": f"reach {base + seed % 7 + i}", "target": base + seed % 7 + i}
                for i in range(size)]

    async def start(self):
        CounterEnvironment.started += 1

    async def open(self, task, sandbox=None):
        return CounterEpisode(task["target"], fail=self.params.get("fail", False))

    async def stop(self):
        CounterEnvironment.stopped += 1


def _tool(name, properties):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": properties}}}


@pytest.fixture(autouse=True)
def counter_source(monkeypatch):
    monkeypatch.setattr(sources, "_adapter", lambda source: CounterEnvironment)
    CounterEnvironment.calls, CounterEnvironment.started, CounterEnvironment.stopped = [], 0, 0


def _config(tmp_path, *extra):
    return tiny_config(tmp_path / "run", "--tasks.source", "ors", "--tasks.env",
                       "http://127.0.0.1:9", "--tasks.size", "6", "--rollout.max_tokens", "64",
                       "--model.max_model_len", "1024", *extra)


TRIES: dict[int, int] = {}


def _policy(prompt: str) -> str:
    """Add the target in one call on even tries of a target, a wrong 1 on odd ones; submit."""
    target = int(re.findall(r"Reach (\d+)", prompt)[-1])
    if "total" in prompt:
        return '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
    TRIES[target] = TRIES.get(target, -1) + 1
    n = target if TRIES[target] % 2 == 0 else 1
    return f'<tool_call>\n{{"name": "add", "arguments": {{"n": {n}}}}}\n</tool_call>'


def test_tasks_come_from_the_environment_and_held_out_ones_are_its_eval_split(tmp_path):
    train, held = make_task_sets(_config(tmp_path))
    assert [t["target"] for t in held] == [104, 105]  # seed 1_000_003 % 7 == 4
    assert [t["target"] for t in train] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match=r"tasks\.env: required with source 'verifiers'"):
        load_config(None, ["--tasks.source", "verifiers"])


@sync
async def test_episodes_record_process_and_outcome_rewards_and_train(tmp_path):
    config = _config(tmp_path)
    async with start_services(config) as s:
        assert CounterEnvironment.started == 1
        script_policy(s, _policy)
        s.admit()
        batch = await s.next_batch()
        groups = [s.pool.get_group(i) for i in batch]
        metrics = await s.train(batch)
    assert CounterEnvironment.stopped == 1
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 8 and all(t.status == "finished" for t in trajs)
    for t in trajs:
        # turn 0 called add (0.1, a process reward), turn 1 submit (the outcome), turn 2 none
        assert len(t.completions) == 2 and t.turn_rewards == [0.1, 0.0]
        assert t.reward in (0.0, 1.0)
    assert {t.reward for t in trajs} == {0.0, 1.0}  # the group has signal
    assert all(e.closed for e in CounterEnvironment.calls)
    assert metrics["num_loss_tokens"] > 0 and s.trainer.step == 1


@sync
async def test_an_unreachable_environment_is_an_infrastructure_abort(tmp_path):
    config = _config(tmp_path, "--tasks.params", "{fail = true}")
    async with start_services(config) as s:
        script_policy(s, _policy)
        trajs, metrics = await one_step(s)
    assert {t.status for t in trajs} == {"aborted_infra"}
    assert all("connection refused" in t.error for t in trajs)
    assert metrics["rollouts_aborted_infra"] == 8 and metrics["num_loss_tokens"] == 0


@sync
async def test_a_model_call_past_the_rollout_timeout_fails_the_rollout_not_the_run(tmp_path):
    config = _config(tmp_path, "--rollout.timeout_s", "1")
    async with start_services(config) as s:
        script_policy(s, _policy, delay_s=3.0)
        trajs = await first_batch(s)
    assert {t.status for t in trajs} == {"failed"}
    assert all("timed out" in t.error or "ReadTimeout" in t.error for t in trajs)


@sync
async def test_a_run_logs_environment_seconds_per_step(tmp_path):
    config = _config(tmp_path, "--max_steps", "1", "--tasks.eval_size", "0")
    played = []

    async def run_scripted():
        from forgerl.controller import startup

        real = startup.start_services

        def patched(*a, **kw):
            cm = real(*a, **kw)

            class Wrap:
                async def __aenter__(self):
                    s = await cm.__aenter__()
                    played.append(script_policy(s, _policy))
                    return s

                async def __aexit__(self, *exc):
                    return await cm.__aexit__(*exc)

            return Wrap()

        import forgerl.controller.loop as loop

        loop.start_services = patched
        try:
            await run(config, progress=False)
        finally:
            loop.start_services = real

    await run_scripted()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    step = records[-1]
    assert step["env_seconds"] > 0.0 and played and played[0]
    # the scripted engine decodes nothing: generation seconds stay the engine's own (none)
    assert step["generation_seconds"] == 0.0 and step["train_seconds"] > 0.0


NS_AGENT = """
import json, os, sys, urllib.request
task = json.load(sys.stdin)
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "policy", "max_tokens": 4,
                     "messages": [{"role": "user", "content": task["question"]}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
             "Content-Type": "application/json"})
urllib.request.urlopen(request).read()
with open(sys.argv[1], "a") as f:
    f.write(os.readlink("/proc/self/ns/net") + " " + os.readlink("/proc/self/ns/pid") + "\\n")
print("0")
"""


@sync
async def test_sandbox_agents_puts_each_command_agent_in_its_own_namespaces(tmp_path):
    """`[sandbox] agents = true` on plain reasoning-gym tasks: each rollout's command agent
    reaches the gateway at the usual URL from its own network and PID namespaces, and no
    sandbox directory is left behind."""
    from forgerl.agents.sandbox import Sandbox

    probe = await Sandbox.open(tmp_path, "probe")
    isolated = probe.isolation == "namespaces"
    await probe.close()
    if not isolated:
        pytest.skip("namespaces need root: this machine gives the process-group sandbox only")
    (tmp_path / "agent.py").write_text(NS_AGENT)
    seen = tmp_path / "seen.txt"
    config = tiny_config(tmp_path / "run", "--agent.command",
                         f'["python", "{tmp_path / "agent.py"}", "{seen}"]',
                         "--agent.preload", "[]", "--sandbox.agents", "true")
    async with start_services(config) as s:
        trajs = await first_batch(s)
    assert {t.status for t in trajs} == {"finished"} and all(t.completions for t in trajs)
    namespaces = seen.read_text().split("\n")[:-1]
    here = f"{os.readlink('/proc/self/ns/net')} {os.readlink('/proc/self/ns/pid')}"
    assert len(namespaces) >= 8 and len(set(namespaces)) == len(namespaces)  # one each
    assert here not in namespaces
    assert not list((tmp_path / "run" / "sandboxes").iterdir())


ODD: list[int] = []


def _odd_policy(prompt: str) -> str:
    """Text beside tool calls (a non-object argument, an unknown tool, one or, every other
    episode, two good adds), then two adds a turn until max_turns; never submits."""
    calls = ['{"name": "add", "arguments": [1, 2]}', '{"name": "mul", "arguments": {"n": 2}}',
             '{"name": "add", "arguments": {"n": 1}}', '{"name": "add", "arguments": {"n": 2}}']
    if "total" in prompt:
        calls = calls[2:]
    else:
        ODD.append(1)
        calls = calls[: 3 + len(ODD) % 2]
    return "Let me add.\n" + "".join(f"<tool_call>\n{c}\n</tool_call>\n" for c in calls)


@sync
async def test_odd_replies_keep_one_turn_reward_per_recorded_turn(tmp_path):
    """Per-call rewards of many calls in one turn add up on that turn; a call the environment
    never saw (bad arguments, unknown tool) has none; an episode out of turns is scored
    (submit never came: outcome 0.0); turn_rewards has one entry per recorded completion. An
    [agent] section without a command is how a tool-agent source sets max_turns."""
    config = _config(tmp_path, "--agent.max_turns", "3",
                     "--rollout.max_tokens", "400", "--model.max_model_len", "4096")
    async with start_services(config) as s:
        script_policy(s, _odd_policy)
        trajs, _ = await one_step(s)  # the trainer checks len(turn_rewards) against the turns
        step = s.trainer.step
    assert {t.status for t in trajs} == {"finished"}
    firsts = []
    for t in trajs:
        assert len(t.completions) == 3 and t.reward == 0.0
        assert t.turn_rewards[1:] == pytest.approx([0.2, 0.2])
        firsts.append(round(t.turn_rewards[0], 6))
    assert sorted(set(firsts)) == [0.1, 0.2] and step == 1
