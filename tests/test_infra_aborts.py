"""CASES.md C24 end to end: an agent killed from outside is an infrastructure abort, kept out of
the loss and of its group's baseline; an engine failure under a failing agent is one too.

The real controller: tiny model, local engine, gateway over HTTP, SQLite pool, a command agent
(a Python script speaking the openai client) and a real SIGKILL sent by this test. The checks
are on what the trainer actually builds (`Trainer.prepare`: its samples and their advantages),
on the pool and on the step metrics, not only on a status field.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from openai import AsyncOpenAI, InternalServerError

from forgerl.controller import start_services
from forgerl.metrics import agent_summary
from tests.test_controller import _solve, sync, tiny_config

pytestmark = pytest.mark.slow

# One model call, then its pid under the session id, then the answer the test writes (or, for
# "KILL0", `kill -TERM 0`: a signal to its own process group).
AGENT = """
import json, os, signal, sys, time
from openai import OpenAI
task = json.loads(sys.stdin.read())
session = os.environ["FORGERL_SESSION_ID"]
OpenAI(max_retries=0).chat.completions.create(
    model=os.environ["OPENAI_MODEL"], max_tokens=4,
    messages=[{"role": "user", "content": task["question"]}])
with open(session + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(session + ".tmp", session + ".pid")
while not os.path.exists(session + ".go"):
    time.sleep(0.02)
answer = open(session + ".go").read()
if answer == "KILL0":
    os.kill(0, signal.SIGTERM)
    time.sleep(30)
print(answer)
"""


async def _wait_files(folder: Path, n: int, within_s: float = 120.0) -> list[Path]:
    deadline = asyncio.get_running_loop().time() + within_s
    while len(found := sorted(folder.glob("*.pid"))) < n:
        assert asyncio.get_running_loop().time() < deadline, found
        await asyncio.sleep(0.05)
    return found


@sync
async def test_sigkilled_agent_is_an_infra_abort_out_of_loss_and_baseline(tmp_path):
    """A group of 4: rollouts 0 and 3 answer right, 1 runs `kill -TERM 0` (its own failure), 2
    is SIGKILLed from outside after its model call. Rollout 2 is stored (status aborted_infra,
    its completion kept) and the trainer builds exactly 3 rows with advantages 1/3, -2/3, 1/3
    (outcomes [1, 0 (failed_reward), 1]); counting it as a failed member would have given
    0.5, -0.5, (-0.5), 0.5. The agent's `kill -TERM 0` reached neither this process (the
    gateway and trainer), its fork server nor the reaper. The step counts rollouts_failed = 1,
    rollouts_aborted_infra = 1 and the console line shows `infra 1`."""
    work = tmp_path / "agent"
    work.mkdir()
    (work / "agent.py").write_text(AGENT)
    config = tiny_config(tmp_path / "run", "--tasks.eval_size", "0", "--max_steps", "1",
                         "--rollout.tasks_per_step", "1", "--scheduler.max_off_policy_steps",
                         "0", "--agent.command", '["python", "agent.py"]', "--agent.cwd",
                         str(work), "--model.max_model_len", "1024")
    async with start_services(config) as s:
        s.admit()
        [task_index] = list(s.rollouts)
        pids = {p.stem: int(p.read_text()) for p in await _wait_files(work, 4)}
        group = s.pool.get_group(task_index)
        index = {t.id: t.rollout_index for t in group.trajectories}
        question = s.pool.get_task(task_index)["question"]
        answers = {0: _solve(question), 1: "KILL0", 3: _solve(question)}
        others = [s.reaper._proc.pid, *(f.result().proc.pid for f in s.forkservers.values())]
        assert len(others) == 2  # the reaper and the agent's fork server
        for session, pid in pids.items():
            if index[session] == 2:
                os.kill(pid, signal.SIGKILL)  # the OOM killer / a sandbox teardown
            else:
                (work / f"{session}.go").write_text(answers[index[session]])
        batch = await s.next_batch()
        assert batch == [task_index]
        group = s.pool.get_group(task_index)
        by_index = {t.rollout_index: t for t in group.trajectories}
        assert [by_index[g].status for g in range(4)] == [
            "finished", "failed", "aborted_infra", "finished"]
        assert by_index[1].error == "agent failed (exit code -15)"
        for pid in others:  # alive, not a zombie
            assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "SR"
        killed = by_index[2]
        assert killed.reward is None and len(killed.completions) == 1  # stored, nothing lost
        assert killed.error.startswith(
            "infrastructure: agent killed by SIGKILL from outside (OOM killer, sandbox or "
            "operator); agent failed (exit code -9)")
        assert [by_index[g].reward for g in (0, 1, 3)] == [1.0, None, 1.0]
        prepared = s.trainer.prepare([group])
        rows = {x.trajectory_id: x for x in prepared.samples}
        assert sorted(rows) == sorted(by_index[g].id for g in (0, 1, 3))
        for g, want in ((0, 1 / 3), (1, -2 / 3), (3, 1 / 3)):
            row = rows[by_index[g].id]
            trained = [a for a, m in zip(row.advantages, row.loss_mask, strict=True) if m]
            assert trained and all(a == pytest.approx(want, abs=1e-12) for a in trained)
        assert prepared.num_loss_tokens == sum(sum(x.loss_mask) for x in prepared.samples)
        metrics = await s.train(batch)
        assert metrics["rollouts_aborted_infra"] == 1 and metrics["rollouts_failed"] == 1
        assert metrics["num_loss_tokens"] > 0 and s.trainer.step == 1  # the gateway served on
        assert agent_summary(metrics).endswith(" infra 1")
        assert s.pool.stats()["trajectories_aborted_infra"] == 1


@sync
async def test_engine_failure_under_a_failing_agent_is_an_infra_abort(tmp_path):
    """The engine fails one session's second call (500 engine_error): that agent gives up
    (raises) and its rollout is aborted_infra, not a trained failure; an agent that raises
    with no engine error is an ordinary failed rollout."""
    calls = {"n": 0}

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": task["question"]}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        calls["n"] += 1
        if calls["n"] == 1:  # the first agent's next call meets a dead engine
            real = s.engine.generate

            async def dead(*args, **kwargs):
                s.engine.generate = real
                raise ConnectionError("engine unreachable")

            s.engine.generate = dead
            with pytest.raises(InternalServerError):
                await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=4)
            raise RuntimeError("no model")
        if calls["n"] == 2:
            raise ValueError("agent bug")
        return "0"

    config = tiny_config(tmp_path / "run", "--tasks.eval_size", "0", "--rollout.group_size",
                         "3", "--rollout.tasks_per_step", "1",
                         "--scheduler.max_off_policy_steps", "0")
    async with start_services(config, agent) as s:
        s.admit()
        batch = await s.next_batch()
        trajs = s.pool.get_group(batch[0]).trajectories
        statuses = sorted(t.status for t in trajs)
        assert statuses == ["aborted_infra", "failed", "finished"], [t.error for t in trajs]
        [infra] = [t for t in trajs if t.status == "aborted_infra"]
        assert infra.error.startswith(
            "infrastructure: the engine failed 1 model call(s) of this session; agent failed")
        assert s.gateway.counters["engine_errors"] == 1
