"""Two policies trained from one multi-agent episode ([[policies]], docs/multi-policy.md).

Pins, on the tiny model with the real gateway over HTTP, the real pool file and the example's
task file: every recorded call lands under the policy its model name names; each policy's
advantages come from its own group (hand-computed); each trainer trains only on its own calls
(a policy without calls keeps its weights); weight versions advance per policy and each engine
runs only its own policy's weights; an unknown model name gets the gateway's 404; a resumed run
restores both policies.
"""

from __future__ import annotations

import itertools
import json
import re
import sqlite3
from pathlib import Path

import openai
import pytest
import torch
from openai import AsyncOpenAI

from forgerl.config import ConfigError, load_config
from forgerl.controller import run, start_services
from forgerl.trainer.advantages import group_advantages
from forgerl.trainer.checkpoint import latest_checkpoint
from forgerl.trainer.policies import policy_group
from forgerl.types import Completion, Group, Trajectory
from tests.test_controller import sync

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "proposer_solver"


PROPOSER_ONLY = """

def score(task, answer):  # replaces the example's: the agent's scripted proposer reward
    return {"proposer": float(answer)}
"""


def _config(run_dir: Path, *extra: str, proposer_only: bool = False):
    tasks = (EXAMPLE / "tasks.py").read_text()
    if proposer_only:
        tasks += PROPOSER_ONLY
    toml = run_dir.parent / f"{run_dir.name}.toml"
    (run_dir.parent / "tasks.py").write_text(tasks)
    toml.write_text('[[policies]]\nname = "solver"\npath = "tiny"\n'
                    '[[policies]]\nname = "proposer"\npath = "tiny"\n'
                    '[tasks]\ndataset = "tasks.py"\nparams = { max_digits = 1 }\n')
    return load_config(toml, [
        "--run_dir", str(run_dir), "--model.max_model_len", "512", "--max_steps", "1",
        "--rollout.group_size", "4", "--rollout.tasks_per_step", "1", "--rollout.max_tokens",
        "6", "--rollout.timeout_s", "60", "--tasks.eval_size", "0", "--trainer.lr", "1e-2",
        "--scheduler.max_in_flight", "1", *extra])


def make_agent(calls: list[tuple[str, int]], solver: bool = True):
    """The example's episode, scripted: a proposer call, then (with `solver`) a solver call of
    two choices continuing the proposer's conversation; the answer alternates per task between
    both attempts right (solver 1.0, proposer 0.5) and one right (solver 0.5, proposer 1.0), so
    both groups have signal.
    Appends (model, choices) for each call to `calls`."""
    counters: dict[str, itertools.count] = {}

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        asked = [{"role": "user", "content": task["question"]}]
        proposal = await client.chat.completions.create(model="proposer", max_tokens=6,
                                                        messages=asked)
        calls.append(("proposer", 1))
        k = next(counters.setdefault(task["question"], itertools.count()))
        if not solver:
            return str(k % 2)  # the proposer-only task file's reward (PROPOSER_ONLY)
        await client.chat.completions.create(  # the proposer's conversation, continued
            model="solver", max_tokens=6, n=2,
            messages=[*asked, {"role": "assistant",
                               "content": proposal.choices[0].message.content},
                      {"role": "user", "content": "What is 1 + 2?"}])
        calls.append(("solver", 2))
        attempts = ["3", "3"] if k % 2 == 0 else ["3", "4"]
        return json.dumps({"problem": [1, 2], "attempts": attempts})

    return agent


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _completion(policy: str) -> Completion:
    return Completion([1, 2], [3], [-0.5], [0], 0, "stop", policy=policy)


def test_each_policy_gets_advantages_from_its_own_group():
    """Three episodes of one task: the solver was called in the first two (rewards 1.0, 0.0),
    the proposer in all three (1.0, 0.5, 0.0). Solver group: the first two, Â = ±0.5; proposer
    group: all three, Â = R - 0.5. The other policy's calls stay as context (train False)."""
    def episode(i: int, rewards: dict[str, float], policies: list[str]) -> Trajectory:
        return Trajectory(f"t{i}", 0, i, [_completion(p) for p in policies],
                          reward=rewards.get("solver", 0.0), status="finished",
                          policy_rewards=rewards)

    group = Group(0, [episode(0, {"solver": 1.0, "proposer": 1.0}, ["proposer", "solver"]),
                      episode(1, {"solver": 0.0, "proposer": 0.5}, ["proposer", "solver"]),
                      episode(2, {"proposer": 0.0}, ["proposer"])])
    solver, proposer = policy_group(group, "solver", first=True), policy_group(group, "proposer")
    assert [t.id for t in solver.trajectories] == ["t0", "t1"]
    assert group_advantages([t.reward for t in solver.trajectories]) == [0.5, -0.5]
    assert group_advantages([t.reward for t in proposer.trajectories]) == [0.5, 0.0, -0.5]
    assert [[c.train for c in t.completions] for t in solver.trajectories] == [[False, True]] * 2
    assert [[c.train for c in t.completions] for t in proposer.trajectories] == [
        [True, False], [True, False], [True]]
    legacy = Group(0, [Trajectory("old", 0, 0, [_completion("")], reward=1.0)])
    assert policy_group(legacy, "solver", first=True).trajectories[0].completions[0].train
    assert policy_group(legacy, "proposer").trajectories == []


@sync
async def test_two_policies_record_train_and_sync_apart(tmp_path):
    calls: list[tuple[str, int]] = []
    config = _config(tmp_path / "run")
    async with start_services(config, make_agent(calls)) as s:
        proposer = s.policies["proposer"]
        before = {"solver": _params(s.trainer.model), "proposer": _params(proposer.trainer.model)}
        assert _same(before["solver"], before["proposer"])  # both "tiny", seed 0
        # an unknown model name: the gateway's 404, naming what it serves
        _, key = s.gateway.open_session(-1)
        client = AsyncOpenAI(base_url=s.server.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.NotFoundError, match="'critic' does not exist; serving "
                                                       "'solver', 'proposer'"):
            await client.chat.completions.create(model="critic", max_tokens=2,
                                                 messages=[{"role": "user", "content": "hi"}])
        s.admit()
        batch = await s.next_batch()
        metrics = await s.train(batch)
        await s.sync_weights()
        # every call is stored under the policy its model name named
        rows = sqlite3.connect(s.run_dir / "pool.sqlite").execute(
            "SELECT c.policy, COUNT(*) FROM completions c JOIN trajectories t ON"
            " c.trajectory_id = t.id WHERE t.task_index = ? GROUP BY c.policy", batch).fetchall()
        assert dict(rows) == {"proposer": 4, "solver": 8}  # G = 4 episodes, n = 2 attempts
        for traj in s.pool.get_group(batch[0]).trajectories:
            for c in traj.completions:  # the prompt is the one sent to the model it names
                asked_solver = "What is 1 + 2?" in s.gateway.renderer.decode(c.prompt_ids)
                assert c.policy == ("solver" if asked_solver else "proposer")
            # the solver extends the proposer's turn (its ids reused) in a trace of its own
            first, *attempts = traj.completions
            assert [c.trace for c in traj.completions] == [0, 1, 1]
            assert all(c.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)]
                       == first.prompt_ids + first.completion_ids for c in attempts)
        # each policy trained on its own rewards: solver [1, .5, 1, .5], proposer [.5, 1, .5, 1]
        assert metrics["policy_solver_reward_mean"] == 0.75
        assert metrics["policy_proposer_reward_mean"] == 0.75
        episodes = s.pool.get_group(batch[0]).trajectories
        for p in ("solver", "proposer"):  # each trained on exactly its own sampled tokens
            own = sum(len(c.completion_ids) for t in episodes for c in t.completions
                      if c.policy == p)
            assert metrics[f"policy_{p}_num_loss_tokens"] == own > 0
        after = {"solver": _params(s.trainer.model), "proposer": _params(proposer.trainer.model)}
        changed = {k for k in before["solver"] if not torch.equal(before["solver"][k],
                                                                  after["solver"][k])}
        assert changed and not _same(after["solver"], after["proposer"])
        assert not _same(before["proposer"], after["proposer"])
        # versions per policy; each engine runs its own policy's weights
        assert s.trainer.step == proposer.trainer.step == 1
        assert s.engine.weight_version == proposer.engine.weight_version == 1
        assert _same(_params(s.engine.model), after["solver"])
        assert _same(_params(proposer.engine.model), after["proposer"])


@sync
async def test_a_policy_without_calls_keeps_its_weights_and_resume_restores_both(tmp_path):
    calls: list[tuple[str, int]] = []
    config = _config(tmp_path / "run", proposer_only=True)
    await run(config, make_agent(calls, solver=False), progress=False)  # only the proposer
    assert {c for c, _ in calls} == {"proposer"}
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if r["step"] == 1)
    assert step["policy_solver_num_loss_tokens"] == 0
    assert step["policy_proposer_num_loss_tokens"] > 0
    saved = latest_checkpoint(tmp_path / "run" / "policies" / "proposer")
    assert saved is not None and saved.name == "step_00000001"
    resumed = _config(tmp_path / "run", "--max_steps", "2", proposer_only=True)
    async with start_services(resumed, make_agent(calls)) as s:
        proposer = s.policies["proposer"]
        assert s.trainer.step == proposer.trainer.step == 1  # the run's step, its own version
        assert s.engine.weight_version == proposer.engine.weight_version == 1
        solver_now, proposer_now = _params(s.trainer.model), _params(proposer.trainer.model)
        from forgerl.models import build_tiny_model

        fresh = _params(build_tiny_model())
        assert _same(solver_now, fresh)  # the solver had no calls: never changed
        assert not _same(proposer_now, fresh)  # the proposer's trained weights came back
        assert proposer.trainer.optimizer.state  # with its AdamW moments


def test_per_policy_rewards_name_policies_of_the_run(tmp_path):
    """A score dict gives the trajectory the first policy's reward (0.0 without one) and is
    stored whole; a name that is no policy of the run is an error (the rollout fails with it),
    as is a dict naming another model in a one-policy run."""
    from types import SimpleNamespace

    from forgerl.controller.rollouts import Rollouts

    def rewards(config, score):
        return Rollouts.policy_rewards(SimpleNamespace(config=config), score)

    two = _config(tmp_path / "run")
    assert rewards(two, {"solver": 0.5, "proposer": 1.0}) == (0.5, {"solver": 0.5,
                                                                    "proposer": 1.0})
    assert rewards(two, {"proposer": 0.0}) == (0.0, {"proposer": 0.0})
    assert rewards(two, 1.0) == (1.0, None)
    with pytest.raises(ValueError, match="rewarded 'critic', which is no policy of this run "
                                         r"\(solver, proposer\)"):
        rewards(two, {"critic": 1.0})
    one = load_config(None, ["--run_dir", str(tmp_path / "one")])
    assert rewards(one, {"policy": 1.0}) == (1.0, {"policy": 1.0})
    with pytest.raises(ValueError, match="'solver'"):
        rewards(one, {"solver": 1.0})


def test_policy_and_policy_rewards_round_trip_and_old_pools_open(tmp_path):
    """Each completion's policy and a trajectory's per-policy rewards come back exactly; a pool
    file from before policies (neither column) opens with them added: policy "" (read as the
    first policy's by `policy_group`), no per-policy rewards."""
    from forgerl.datapool.sqlite import SQLitePool

    path = tmp_path / "pool.sqlite"
    pool = SQLitePool(path)
    pool.add_task(0, {})
    tid = pool.create_trajectory(0, rollout_index=0)
    for policy in ("proposer", "solver"):
        pool.add_completion(tid, _completion(policy))
    pool.finish_trajectory(tid, "finished", reward=0.5,
                           policy_rewards={"solver": 0.5, "proposer": 1.0})
    traj = pool.get_trajectory(tid)
    assert [c.policy for c in traj.completions] == ["proposer", "solver"]
    assert (traj.reward, traj.policy_rewards) == (0.5, {"solver": 0.5, "proposer": 1.0})
    pool.close()
    db = sqlite3.connect(path)  # as written before policies: drop both columns
    db.executescript("ALTER TABLE completions DROP COLUMN policy;"
                     " ALTER TABLE trajectories DROP COLUMN policy_rewards;")
    db.close()
    pool = SQLitePool(path)
    old = pool.get_trajectory(tid)
    assert [c.policy for c in old.completions] == ["", ""] and old.policy_rewards is None
    assert old.reward == 0.5
    pool.close()


@sync
async def test_the_example_agent_runs_as_a_process_and_each_call_lands_under_its_policy(
        tmp_path):
    """examples/proposer_solver as shipped (agent.py a real process, tasks.py the verifier), on
    the tiny model: one group of G = 4 episodes; every proposer call is recorded under
    "proposer", the solver's two attempts (when the random proposer's reply parsed) under
    "solver", and each episode's per-policy rewards are stored."""
    text = (EXAMPLE / "config.toml").read_text().replace('path = "smollm2"', 'path = "tiny"')
    text = text.replace('[agent]\n', f'[agent]\ncwd = "{EXAMPLE}"\n').replace(
        'dataset = "tasks.py"', f'dataset = "{EXAMPLE / "tasks.py"}"')
    (tmp_path / "config.toml").write_text(text)
    config = load_config(tmp_path / "config.toml", [
        "--run_dir", str(tmp_path / "run"), "--tasks.eval_size", "0", "--rollout.max_tokens",
        "8", "--rollout.tasks_per_step", "1", "--scheduler.max_in_flight", "1"])
    async with start_services(config) as s:
        s.admit()
        [task] = await s.next_batch()
        group = s.pool.get_group(task)
    assert [t.status for t in group.trajectories] == ["finished"] * 4
    for traj in group.trajectories:
        policies = [c.policy for c in traj.completions]
        assert policies in (["proposer"], ["proposer", "solver", "solver"])
        assert set(traj.policy_rewards) == set(policies)
        assert traj.policy_rewards["proposer"] in (0.0, 0.5, 1.0)


@sync
async def test_a_policy_with_another_tokenizer_is_refused_before_the_run_is_written(tmp_path):
    toml = tmp_path / "config.toml"
    toml.write_text('[[policies]]\nname = "solver"\npath = "tiny"\n'
                    '[[policies]]\nname = "proposer"\npath = "smollm2"\n'
                    f'[tasks]\ndataset = "{EXAMPLE / "tasks.py"}"\n')
    config = load_config(toml, ["--run_dir", str(tmp_path / "run"), "--model.max_model_len",
                                "512", "--tasks.eval_size", "0"])
    with pytest.raises(ConfigError, match=re.escape(
            "policies.1.path: 'smollm2' does not share the first policy's tokenizer ('tiny')")):
        async with start_services(config, make_agent([])):
            pass
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["..", ".", ".hidden"])
def test_a_policy_name_that_is_a_dot_path_is_refused(tmp_path, name):
    """run_dir/policies/<name> holds a policy's checkpoints: ".." was run_dir itself, where the
    first policy's checkpoints are (one would overwrite or resume the other's)."""
    toml = tmp_path / "config.toml"
    toml.write_text(f'[[policies]]\nname = "solver"\npath = "tiny"\n'
                    f'[[policies]]\nname = "{name}"\npath = "tiny"\n')
    with pytest.raises(ConfigError, match=r"^policies\.1\.name: String should match pattern"):
        load_config(toml, [])
