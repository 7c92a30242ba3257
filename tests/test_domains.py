"""Mixed-domain training (issue 11 item 4): `[[domains]]` in one run, on the tiny model.

Two chain_sum domains ("small": 1-digit terms, "big": 2-digit, its own agent command in one
test): tasks interleaved by weight (smooth weighted round robin, checked by hand for 3:1), held-out
sets per domain, groups of both domains in one training batch, per-domain reward, accuracy,
completion length and off-policy lag per step, per-domain held-out accuracy, and each domain's
rollouts run by its own agent.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from forgerl.config import ConfigError, load_config
from forgerl.controller import make_task_sets, run, start_services

from .test_controller import make_agent, sync, tiny_config

pytestmark = pytest.mark.slow

SMALL = ('{{name = "small", weight = {w}, tasks = {{params = {{min_terms = 2, max_terms = 2, '
         'max_digits = 1}}, size = 40, eval_size = 2}}}}')
BIG = ('{{name = "big", tasks = {{params = {{min_terms = 2, max_terms = 2, min_digits = 2, '
       'max_digits = 2}}, size = 40, eval_size = 1}}{agent}}}')


def _domains(tmp_path, *extra, small_weight: float = 3, big_agent: str = ""):
    domains = f"[{SMALL.format(w=small_weight)}, {BIG.format(agent=big_agent)}]"
    return tiny_config(tmp_path / "run", "--domains", domains, *extra)


def test_tasks_interleave_by_weight_and_held_out_sets_stay_per_domain(tmp_path):
    train, held = make_task_sets(_domains(tmp_path))
    assert [t["domain"] for t in train[:8]] == ["small", "small", "big", "small"] * 2
    assert sum(t["domain"] == "small" for t in train) == 3 * sum(t["domain"] == "big"
                                                               for t in train)
    assert [t["domain"] for t in held] == ["small", "small", "big"]
    assert not {t["question"] for t in held} & {t["question"] for t in train}
    bad = tiny_config(tmp_path / "bad", "--domains", '[{name = "x", tasks = {dataset = "nope"}}]')
    with pytest.raises(ConfigError, match=r"^domains\.0\.tasks\.dataset: "):
        make_task_sets(bad)
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(None, ["--domains", '[{name = "a"}, {name = "a"}]'])


@sync
async def test_one_batch_trains_both_domains_and_logs_each(tmp_path):
    config = _domains(tmp_path, "--max_steps", "1", small_weight=1)
    await run(config, agent=make_agent(), progress=False)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals, step = records[0], records[-1]
    assert set(evals) >= {"domain_small_eval_accuracy", "domain_big_eval_accuracy"}
    assert (step["domain_small_groups"], step["domain_big_groups"]) == (1.0, 1.0)
    for d in ("small", "big"):
        assert step[f"domain_{d}_reward_mean"] == 0.5  # make_agent: right on every other try
        assert step[f"domain_{d}_accuracy"] == 0.5
        assert 1 <= step[f"domain_{d}_completion_tokens"] <= 8  # rollout.max_tokens
        assert step[f"domain_{d}_off_policy_lag"] == 0.0  # both groups sampled at version 0
        assert step[f"domain_{d}_entropy"] > 0  # the values: tests/trainer/test_masks.py
    # the step's entropy is the loss-token-weighted mean of the two domains'
    assert min(step["domain_small_entropy"], step["domain_big_entropy"]) <= step[
        "entropy_mean"] <= max(step["domain_small_entropy"], step["domain_big_entropy"])
    assert step["entropy_collapse_steps"] in (0.0, 1.0) and step["nonfinite_tokens"] == 0.0
    from forgerl.plot import plot_run

    assert plot_run(tmp_path / "run").stat().st_size > 0


@sync
async def test_each_domain_runs_its_own_agent(tmp_path):
    crashing = json.dumps([sys.executable, "-c", "raise SystemExit(3)"])
    config = _domains(tmp_path, small_weight=1, big_agent=f", agent = {{command = {crashing}}}")
    async with start_services(config, make_agent()) as s:
        s.admit()
        admitted = sorted(s.rollouts)
        await asyncio.gather(*s.rollouts.values())
        statuses: dict[str, set[str]] = {}
        for i in admitted:
            statuses.setdefault(s.domain_of(i), set()).update(
                t.status for t in s.pool.get_group(i).trajectories)
        assert statuses == {"small": {"finished"}, "big": {"failed"}}


@sync
async def test_a_domain_whose_every_rollout_fails_stops_the_run(tmp_path):
    """The other domain's groups train, so the run-wide streak of failed groups never grew;
    per domain, 16 failed groups of "big" in a row stop the run naming it (a breaker ran such
    a run to its end with exit 0)."""
    crashing = json.dumps([sys.executable, "-c", "import sys; sys.exit('big agent broke')"])
    config = _domains(tmp_path, "--tasks.eval_size", "0", "--rollout.tasks_per_step", "1",
                      "--max_steps", "60", small_weight=1,
                      big_agent=f", agent = {{command = {crashing}}}")
    with pytest.raises(RuntimeError, match=r"every rollout of the last 16 groups of domain "
                                           r"'big' failed; last error: agent failed \(exit "
                                           r"code 1\): big agent broke"):
        await run(config, agent=make_agent(), progress=False)
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("domain_small_groups") for r in steps)  # the other domain did train

