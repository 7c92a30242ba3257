"""End-to-end RL loop on the tiny model: gateway over HTTP, local engine, SQLite pool, windowed
FIFO scheduler, CISPO trainer, weight sync, checkpoints, resume, metrics and plot.

Pins: a 2-step run changes every trained parameter; the engine's weight_version follows the
trainer's steps; recorded completions are token-exact; a run resumes from its checkpoint without
training a group twice; an agent that crashes marks its trajectory failed and the run goes on.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import re
import sqlite3
import sys
from pathlib import Path

import pytest
import torch
from openai import AsyncOpenAI

from forgerl.config import load_config
from forgerl.controller import run, start_services

pytestmark = pytest.mark.slow

EXAMPLE_AGENT = Path(__file__).resolve().parents[1] / "examples" / "chain_sum" / "agent.py"


def _solve(question: str) -> str:
    """The exact answer of a reasoning-gym chain_sum question ("... problem: 4 - 1 =")."""
    expr = question.rsplit(":", 1)[1].replace("=", "").strip()
    assert re.fullmatch(r"[-+ 0-9]+", expr), expr
    return str(eval(expr))  # digits, + and - only (checked above)


def make_agent():
    """A white-box agent: one chat call through the gateway, then a right answer on every other
    episode of the same question, so every group's rewards vary and advantages are non-zero."""
    counters: dict[str, itertools.count] = {}

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=8
        )
        assert reply.choices[0].message.role == "assistant"
        counter = counters.setdefault(task["question"], itertools.count())
        return _solve(task["question"]) if next(counter) % 2 == 0 else "wrong"

    return agent


def tiny_config(run_dir: Path, *extra: str):
    return load_config(None, [
        "--run_dir", str(run_dir), "--model.path", "tiny", "--model.max_model_len", "512",
        "--max_steps", "2", "--rollout.group_size", "4", "--rollout.tasks_per_step", "2",
        "--rollout.max_tokens", "8", "--rollout.timeout_s", "60",
        "--tasks.params", "{min_terms = 2, max_terms = 2, max_digits = 1}",
        "--tasks.eval_size", "2", "--tasks.eval_every", "1", "--trainer.lr", "1e-3",
        "--trainer.checkpoint_every", "1", *extra,
    ])


def sync(fn):
    """Run an async test function to completion in a fresh event loop."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@sync
async def test_two_steps_change_every_parameter_and_sync_weights(tmp_path):
    config = tiny_config(tmp_path / "run")
    async with start_services(config, make_agent()) as s:
        before = _params(s.trainer.model)
        for _ in range(2):
            s.admit()
            batch = await s.next_batch()
            metrics = await s.train(batch)
            await s.sync_weights()
            assert metrics["num_loss_tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert s.trainer.step == 2 and s.engine.weight_version == 2
        after = _params(s.trainer.model)
        unchanged = [k for k in before if torch.equal(before[k], after[k])]
        assert unchanged == []
        engine_state = s.engine.model.state_dict()
        for name, value in s.trainer.model.state_dict().items():
            assert torch.equal(engine_state[name], value), name
        # Every recorded completion is token-exact and its logprobs line up with its ids.
        group = s.pool.get_group(batch[0])
        completions = [c for t in group.trajectories for c in t.completions]
        assert completions and all(len(c.completion_ids) == len(c.logprobs) for c in completions)


@sync
async def test_no_group_is_generated_past_the_last_step(tmp_path):
    # FIFO with L = 2 admits 3k tasks at once; a 1-step run can train only k of them, so the
    # other 2k would decode beside the last step and be cancelled at shutdown (issue 14)
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "--max_steps", "1", "--scheduler.policy.type", "fifo")
    await run(config, agent=make_agent(), progress=False)
    db = sqlite3.connect(run_dir / "pool.sqlite")
    tasks = db.execute("SELECT task_index, status FROM tasks ORDER BY task_index").fetchall()
    db.close()
    assert tasks == [(0, "trained"), (1, "trained")]


@sync
async def test_run_writes_metrics_resumes_and_plots(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir)
    await run(config, agent=make_agent(), progress=False)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 1, 2]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2]
    for r in records[1:]:  # every second of a step is in one phase
        phases = (r["wait_seconds"] + r["train_seconds"] + r["sync_seconds"]
                  + r.get("eval_seconds", 0.0) + r["other_seconds"])
        assert phases == pytest.approx(r["step_seconds"], abs=1e-6)
        assert min(r["wait_seconds"], r["train_seconds"], r["sync_seconds"]) > 0
        assert r["engine_decode_rows"] >= r["engine_decode_steps"] > 0
    histogram = records[-1]["off_policy_lag_histogram"]  # trained groups per off-policy lag
    assert sum(histogram.values()) >= 4 and set(histogram) <= {"0", "1"}
    assert json.loads((run_dir / "config.json").read_text())["max_steps"] == 2
    assert list((run_dir / "tb").iterdir())
    # Resume to step 3: starts from the step-2 checkpoint, never trains a group twice.
    await run(tiny_config(run_dir, "--max_steps", "3"), agent=make_agent(), progress=False)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2, 3]
    db = sqlite3.connect(run_dir / "pool.sqlite")
    trained = db.execute("SELECT task_index, trained_step FROM tasks WHERE status='trained'")
    steps = sorted(step for _, step in trained)
    assert steps == [1, 1, 2, 2, 3, 3]
    from forgerl.plot import plot_run

    png = plot_run(run_dir)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@sync
async def test_command_agent_and_crashing_agent(tmp_path, caplog):
    """The example black-box agent (a subprocess speaking the openai client) trains one step; a
    crashing agent command marks its trajectories failed, logs one line per rollout naming its
    task, rollout, session and agent log (a held-out task by its index), and the run goes on."""
    config = tiny_config(tmp_path / "run", "--max_steps", "1", "--tasks.eval_size", "0",
                         "--agent.command", json.dumps(["python", str(EXAMPLE_AGENT)]),
                         "--agent.max_turns", "2", "--model.max_model_len", "2048")
    async with start_services(config) as s:
        s.admit()
        batch = await s.next_batch()
        group = s.pool.get_group(batch[0])
        statuses = [t.status for t in group.trajectories]
        assert statuses == ["finished"] * 4, group.trajectories[0].error
        assert all(t.completions for t in group.trajectories)
    crashing = json.dumps([sys.executable, "-c", "raise SystemExit(3)"])
    crash = tiny_config(tmp_path / "crash", "--max_steps", "1", "--tasks.eval_size", "2",
                        "--agent.command", crashing)
    async with start_services(crash) as s:
        s.admit()
        batch = await s.next_batch()
        group = s.pool.get_group(batch[0])
        assert [t.status for t in group.trajectories] == ["failed"] * 4
        lines = sorted(m for m in (r.getMessage() for r in caplog.records)
                       if m.startswith("rollout ") and f" of task {batch[0]} " in m)
        assert lines == sorted(
            f"rollout {t.rollout_index} of task {batch[0]} (session {t.id}) failed; agent log "
            f"agent_logs/task{batch[0]:06d}_r{t.rollout_index}.log" for t in group.trajectories)
        metrics = await s.train(batch)
        assert metrics["num_loss_tokens"] == 0 and s.trainer.step == 0
        assert (await s.evaluate())["eval_accuracy"] == 0.0  # held-out tasks by their own index
        lines = sorted(m for m in (r.getMessage() for r in caplog.records)
                       if m.startswith("held-out task "))
        assert [line.split(" (session")[0] for line in lines] == [
            "held-out task 0", "held-out task 1"], lines
        assert lines[0].endswith("failed; agent log agent_logs/eval0000.log"), lines


@pytest.mark.parametrize("on_timeout", ["finalize", "redispatch"])
@sync
async def test_hung_agent_is_timed_out_and_group_goes_on(tmp_path, on_timeout):
    """One rollout hangs forever: after rollout.timeout_s (10 s, roomy for a loaded machine) its
    group is finalised with the others (finalize) or the rollout is run again (redispatch); the
    trainer never waits forever."""
    calls = itertools.count()
    inner = make_agent()

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        if next(calls) == 1:
            await asyncio.sleep(3600)
        return await inner(task, base_url, api_key)

    config = tiny_config(tmp_path / "run", "--tasks.eval_size", "0", "--rollout.tasks_per_step",
                         "1", "--rollout.timeout_s", "10", "--rollout.on_timeout", on_timeout,
                         "--scheduler.max_off_policy_steps", "0")  # one group at a time
    async with start_services(config, agent) as s:
        start = asyncio.get_running_loop().time()
        s.admit()
        batch = await s.next_batch()
        assert asyncio.get_running_loop().time() - start < 60  # timeout 10 s + generation
        statuses = sorted(t.status for t in s.pool.get_group(batch[0]).trajectories)
        if on_timeout == "finalize":
            assert statuses == ["failed", "finished", "finished", "finished"]
        else:
            assert statuses == ["aborted", "finished", "finished", "finished", "finished"]
        metrics = await s.train(batch)
        assert metrics["num_loss_tokens"] > 0 or metrics["groups_skipped"] == 1


@sync
async def test_a_finished_group_frees_its_slot_even_while_a_step_trains(tmp_path):
    """max_in_flight = 1 < k = 2: groups generate one at a time, and the group after a
    finished one is admitted at once, during a training step too (not at the next step)."""
    import time

    config = tiny_config(tmp_path / "run", "--scheduler.max_in_flight", "1",
                         "--scheduler.max_off_policy_steps", "2")
    generating: list[int] = []
    inner = make_agent()

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        generating.append(len(s.rollouts))
        return await inner(task, base_url, api_key)

    async with start_services(config, agent) as s:
        s.admit()
        assert list(s.rollouts) == [0]
        assert await s.next_batch() == [0, 1]
        train_step, admitted_during_step = s.trainer.train_step, []

        def slow_step(groups):  # in the trainer thread: wait for task 3 to be admitted
            deadline = time.monotonic() + 30
            while 3 not in s.scheduler.queue.admitted and time.monotonic() < deadline:
                time.sleep(0.02)
            admitted_during_step.append(3 in s.scheduler.queue.admitted)
            return train_step(groups)

        s.trainer.train_step = slow_step
        await s.train([0, 1])
        assert admitted_during_step == [True]
        assert set(generating) == {1}  # never two groups at once


@sync
async def test_the_default_scheduler_generates_later_steps_while_a_step_trains(tmp_path):
    """Default scheduler (FIFO, L = 2, k = 2) in the real loop: tasks 0-5 start at once; after
    step 1, step 4's tasks 6 and 7 are admitted, so while step 2 trains the groups of steps
    3-4 are generating or waiting (the old default, W = 4 at L = 1, admitted nothing there), and
    no trained group's lag exceeds 2."""
    config = tiny_config(tmp_path / "run", "--max_steps", "4", "--tasks.eval_size", "0")
    async with start_services(config, make_agent()) as s:
        s.max_steps = config.max_steps
        train_step, seen = s.trainer.train_step, []

        def recording_step(groups):  # in the trainer thread
            seen.append(sorted(s.scheduler.queue.admitted))  # untrained, this batch included
            return train_step(groups)

        s.trainer.train_step = recording_step
        s.admit()
        assert sorted(s.rollouts) == [0, 1, 2, 3, 4, 5]
        for _ in range(2):
            s.admit()
            await s.train(await s.next_batch())
            await s.sync_weights()
        # admitted and untrained while each step trains: step 2 trains 2, 3 beside 4-7
        assert seen == [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]]
        assert max(s.scheduler.lag_counts) <= 2


@pytest.mark.parametrize(("limit", "most"), [(0, 4), (1, 1), (3, 3)])
@sync
async def test_eval_concurrency_bounds_held_out_rollouts_in_flight(tmp_path, limit, most):
    """[tasks] eval_concurrency = K runs at most K held-out rollouts at once (0: all 4); every
    task is still evaluated once, and right answers give eval_accuracy 1."""
    config = tiny_config(tmp_path / "run", "--tasks.eval_size", "4",
                         "--tasks.eval_concurrency", str(limit))
    now, peak = [0], [0]

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        now[0] += 1
        peak[0] = max(peak[0], now[0])
        await asyncio.sleep(0.2)  # every rollout is started before the first one ends
        await make_agent()(task, base_url, api_key)
        now[0] -= 1
        return _solve(task["question"])

    async with start_services(config, agent) as s:
        metrics = await s.evaluate()
    assert peak[0] == most
    assert metrics["eval_accuracy"] == 1.0 and metrics["eval_rollout_seconds"] >= 0.2


def test_duration_bias_compares_trained_with_admission_order(tmp_path):
    """Quick-first training shows up: tasks 0 and 2 (1 s, 2 s) were trained while task 1 (5 s
    per rollout) was admitted before task 2; a still-running rollout counts with its elapsed
    time."""
    from forgerl.controller import Services

    config = tiny_config(tmp_path, "--rollout.group_size", "2")
    s = Services(config, tmp_path, *([None] * 8), agent=None, logger=None)
    now = __import__("time").time()
    s.group_started = {0: now - 10, 1: now - 10, 2: now - 10, 3: now - 7}
    s.rollout_seconds = {0: [1.0, 1.0], 1: [5.0, 5.0], 2: [2.0, 2.0], 3: [4.0]}
    s.trained_tasks = [0, 2]
    stats = s.duration_bias()
    assert stats["rollout_seconds_trained_mean"] == pytest.approx(1.5)
    assert stats["rollout_seconds_admitted_mean"] == pytest.approx(3.0)
    s.trained_tasks = [0, 2, 1, 3]
    s.rollouts = {3: None}  # task 3 has one rollout still running for 7 s
    stats = s.duration_bias()
    assert stats["rollout_seconds_admitted_mean"] == pytest.approx((2 + 10 + 4 + 4 + 7) / 8,
                                                                   abs=0.05)
    assert stats["rollout_seconds_trained_p90"] == 5.0


@pytest.mark.smollm2
@sync
async def test_packaged_smollm2_one_step_end_to_end(tmp_path):
    """The real packaged model through the whole loop: gateway (SmolLM2 ChatML renderer), local
    engine, pool, one CISPO step, weight sync; the recorded ids decode to what the agent saw."""
    seen: list[str] = []
    inner = make_agent()

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=6
        )
        seen.append(reply.choices[0].message.content or "")
        return await inner(task, base_url, api_key)

    config = tiny_config(tmp_path / "run", "--model.path", "smollm2", "--model.max_model_len",
                         "512", "--tasks.eval_size", "0", "--rollout.group_size", "2",
                         "--rollout.tasks_per_step", "1", "--scheduler.max_off_policy_steps", "0",
                         "--trainer.lr", "1e-5")
    async with start_services(config, agent) as s:
        s.admit()
        batch = await s.next_batch()
        before = _params(s.trainer.model)
        metrics = await s.train(batch)
        await s.sync_weights()
        assert metrics["num_loss_tokens"] > 0 and s.engine.weight_version == 1
        after = _params(s.trainer.model)
        assert sum(not torch.equal(before[k], after[k]) for k in before) == len(before)
        renderer = s.gateway.renderer
        first_turns = [t.completions[0] for t in s.pool.get_group(batch[0]).trajectories]
        texts = [renderer.decode([i for i in c.completion_ids if i != renderer.end_of_turn_id])
                 for c in first_turns]
        assert len(seen) == 2 and all(any(x in t for t in texts) for x in seen)


@sync
async def test_a_run_whose_every_rollout_fails_stops_with_the_agent_error(tmp_path):
    """A systematic failure (here the agent always raises) ends the run with one message that
    names the agent's error, instead of consuming the task stream without a step."""

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        raise ValueError("prompt has 841 tokens; max_model_len is 512")

    config = tiny_config(tmp_path / "run", "--tasks.eval_size", "0",
                         "--scheduler.max_off_policy_steps", "8")  # many groups buffered
    with pytest.raises(RuntimeError, match=r"every rollout of the last 16 groups failed; last "
                                           r"error: agent failed: ValueError: prompt has 841 "):
        await run(config, agent=agent, progress=False)
    db = sqlite3.connect(tmp_path / "run" / "pool.sqlite")
    statuses = dict(db.execute("SELECT status, COUNT(*) FROM trajectories GROUP BY status"))
    assert statuses["failed"] >= 16 * 4  # every failure is recorded, none dropped
    assert set(statuses) <= {"failed", "aborted"}  # aborted: cancelled at the stop
    db.close()
    # Fixed agent, same run directory: the failed groups left in the buffer are trained first
    # (nothing to learn from them) and do not count against the resumed run.
    await run(tiny_config(tmp_path / "run", "--tasks.eval_size", "0", "--max_steps", "1",
                          "--scheduler.max_off_policy_steps", "8"),
              agent=make_agent(), progress=False)


@sync
async def test_a_run_whose_agent_never_calls_the_model_fails_every_rollout(tmp_path):
    """A rollout whose agent answered without any model call is failed ("no recorded call"),
    never scored nor trained (it used to be finished with its reward); when every rollout is
    such, the run stops at the failure streak with that error."""

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        return _solve(task["question"])  # right, but no model call: nothing to train

    config = tiny_config(tmp_path / "run", "--tasks.eval_size", "0", "--rollout.group_size", "2",
                         "--rollout.tasks_per_step", "1")
    with pytest.raises(RuntimeError, match=r"every rollout of the last 16 groups failed; last "
                                           r"error: no recorded call"):
        await run(config, agent=agent, progress=False)
    db = sqlite3.connect(tmp_path / "run" / "pool.sqlite")
    rows = set(db.execute("SELECT status, error, reward FROM trajectories"))
    db.close()
    assert rows <= {("failed", "no recorded call", None), ("aborted", "cancelled", None)}
    assert ("failed", "no recorded call", None) in rows


@sync
async def test_a_run_without_learning_signal_stops(tmp_path):
    """QA: an agent whose groups never differ (one model call, one answer) gave no step and no
    end; after max(64, 16 k) groups in a row without signal the run stops with one message."""
    calls = itertools.count()

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        next(calls)
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        return "no idea"

    config = tiny_config(tmp_path / "run", "--tasks.eval_size", "0", "--rollout.group_size", "2",
                         "--rollout.tasks_per_step", "1")
    with pytest.raises(RuntimeError, match=r"no learning signal in the last 64 groups: every "
                                           r"group's rewards were equal \(last batch's mean "
                                           r"reward 0\.000\)"):
        await run(config, agent=agent, progress=False)
    assert 2 * 64 <= next(calls) <= 2 * (64 + 4)  # the stop comes at the 64th trained group


@sync
async def test_step_records_and_console_line_carry_the_agent_statistics(tmp_path, capsys):
    """Per step, `rollout_stats` of the trained groups is in the metrics record and the console
    line. Per group of 4 the agent makes 1, 2 (extending the first call: a prefix hit), 1 and 2
    (a rewritten first message: a miss) model calls, so turns = 6/4, hits = misses = 1 per
    group; the random tiny model writes no `<tool_call>`, so the tool-call rate is 0 and the
    valid-call rate has no attempts (null). Held-out evaluations log tool-call rate and turns
    of their own (greedy) rollouts."""
    counters: dict[str, itertools.count] = {}

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        n = next(counters.setdefault(task["question"], itertools.count()))
        messages = [{"role": "user", "content": task["question"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=8)
        if n % 2 == 1:
            if n % 4 == 1:
                messages += [reply.choices[0].message.model_dump(include={"role", "content"}),
                             {"role": "user", "content": "Sure?"}]
            else:
                messages = [{"role": "user", "content": "Rewritten: " + task["question"]}]
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        return _solve(task["question"]) if n % 2 == 0 else "wrong"

    run_dir = tmp_path / "run"
    await run(tiny_config(run_dir, "--max_steps", "1", "--tasks.eval_size", "2"), agent=agent)
    first, record = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # held-out: each question's first episode (step 0) makes 1 call, its second (step 1) 2
    assert (first["eval_tool_call_rate"], first["eval_turns_per_trajectory"]) == (0.0, 1.0)
    assert (record["eval_tool_call_rate"], record["eval_turns_per_trajectory"]) == (0.0, 2.0)
    assert record["turns_per_trajectory"] == 1.5
    assert 0.1 < record["rss_gib"] <= record["peak_rss_gib"] < 24  # GiB, this process
    assert (record["prefix_hits"], record["prefix_misses"]) == (2.0, 2.0)
    assert (record["tool_call_rate"], record["tool_calls"], record["tool_call_attempts"]) == (
        0.0, 0.0, 0.0)
    assert record["tool_call_valid_rate"] is None  # NaN (no attempts) is written as null
    out = capsys.readouterr().out
    assert "tools 0.00 valid - turns 1.50 prefix 2/2" in out.splitlines()[0], out


def test_engine_packed_weights_option_reaches_the_engine(tmp_path):
    async def main() -> list[bool]:
        packed = []
        for flag in ("true", "false"):
            config = tiny_config(tmp_path / flag, "--engine.packed_weights", flag)
            async with start_services(config, make_agent()) as s:
                packed.append(s.engine._packed)
        return packed

    assert asyncio.run(main()) == [True, False]


def test_cuda_allocator_peak_is_logged_per_record_and_reset(monkeypatch):
    """Issue 14 item 4: on a GPU a step record carries the CUDA caching allocator's peak on the
    trainer's device since the previous record (GiB), which is then reset; on a CPU there is no
    such field."""
    import torch

    from forgerl.controller import cuda_peak_gib

    assert cuda_peak_gib(torch.device("cpu")) == {}
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda d: 3 * 2**30 if d == torch.device("cuda:1") else 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    assert cuda_peak_gib(torch.device("cuda:1")) == {"cuda_peak_gib": 3.0}
    assert resets == [torch.device("cuda:1")]


def test_config_changes_name_each_changed_setting():
    from forgerl.controller import config_changes

    old = tiny_config(Path("/tmp/r")).model_dump()
    new = tiny_config(Path("/tmp/r"), "--tasks.seed", "5", "--max_steps", "9").model_dump()
    assert config_changes(old, old) == []
    assert config_changes(old, new) == [f"max_steps: {old['max_steps']!r} -> 9",
                                        f"tasks.seed: {old['tasks']['seed']!r} -> 5"]
