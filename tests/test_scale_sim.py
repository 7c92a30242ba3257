"""benchmarks/scale_sim.py on configurations whose results are computable by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.scale_sim import Costs, Layout, Workload, simulate

FREE = Costs(gateway_cpu_s_per_call=0.0, pool_tx_s=0.0, pool_call_s=0.0, rollout_writes_s=0.0,
             scheduler_admit_s=0.0, scheduler_admit_s_per_admitted=0.0, step_a=0.1, step_b=0.0,
             shared_step_a=0.1, shared_step_b=0.0, prefill_tokens_per_s=1e9,
             trainer_step_s=1.0, trainer_s_per_token=0.0, weight_sync_s=0.2)
# only the gateway costs (0.01 CPU s per call): calls/s = gateways / 0.01
GATEWAY_ONLY = replace(FREE, gateway_cpu_s_per_call=0.01, step_a=0.0, shared_step_a=0.0,
                       trainer_step_s=0.0, weight_sync_s=0.0)


def test_synchronous_step_is_rollout_plus_train_plus_sync():
    # one rollout per step, synchronous (L = 0): env 0.5 + prefill 0.1 + 10 tokens x 0.1
    # + env 0.5 = 2.1 s of rollout, then 1.0 s of training and 0.2 s of weight sync
    work = Workload(group_size=1, calls=1, env_s=0.5, completion_tokens=10, new_prompt_tokens=0)
    out = simulate(FREE, work, Layout(k=1, max_off_policy_steps=0), steps=6)
    assert out["step_s"] == pytest.approx(3.3)
    assert out["lag_max"] == 0
    assert out["trainer_busy"] == pytest.approx(6.0 / (6 * 3.3 - 0.2))  # ends at the 6th step
    assert out["trainer_busy_steady"] == pytest.approx(1.0 / 3.3)


def test_timed_out_rollout_ends_its_group_and_is_not_trained():
    # the synchronous step above with a 1.0 s rollout timeout: the rollout (2.1 s) ends at
    # 1.0 s, its 10 completion tokens untrained: training 1.0 + 100 prompt tokens x 0.001 s,
    # weight sync 0.2, so a step every 1.0 + 1.1 + 0.2 = 2.3 s (2.31 if its tokens counted)
    work = Workload(group_size=1, calls=1, env_s=0.5, completion_tokens=10, new_prompt_tokens=0)
    costs = replace(FREE, trainer_s_per_token=0.001)
    out = simulate(costs, work, Layout(k=1, max_off_policy_steps=0, rollout_timeout_s=1.0),
                   steps=6)
    assert out["step_s"] == pytest.approx(2.3)
    assert out["timed_out"] == 1.0
    untimed = simulate(costs, work, Layout(k=1, max_off_policy_steps=0), steps=6)
    assert untimed["step_s"] == pytest.approx(2.1 + 1.11 + 0.2) and untimed["timed_out"] == 0.0


def test_decode_batch_shares_the_step():
    # 4 calls at once on one engine, step 0.1 + 0.05 x 4 = 0.3 s: 10 tokens take 3.0 s after one
    # prefill each (0.1 s, back to back): the group ends at 0.4 + 3.0 = 3.4 s; one step of 1.0 s
    costs = replace(FREE, step_b=0.05)
    work = Workload(group_size=4, calls=1, env_s=0.0, completion_tokens=10, new_prompt_tokens=0)
    out = simulate(costs, work, Layout(k=1, max_off_policy_steps=0), steps=1)
    assert out["seconds"] == pytest.approx(3.4 + 1.0)


def test_saturated_gateway_serves_one_call_per_cpu_second():
    # 0.01 CPU s per call, nothing else costs: calls/s = 1 / 0.01 whatever the offered load
    # (32 rollouts in flight hold up to 32 calls half served at the end: < 2 % of 2,000)
    work = Workload(group_size=8, calls=20, env_s=0.0, completion_tokens=1, new_prompt_tokens=0)
    layout = Layout(k=2, max_off_policy_steps=None, policy="fffo", max_in_flight=4)
    out = simulate(GATEWAY_ONLY, work, layout, steps=10**6, max_seconds=20.0)
    assert out["calls_per_s"] == pytest.approx(100.0, rel=0.02)
    assert out["gateway_busy_max"] == pytest.approx(1.0, rel=0.01)


def test_two_gateways_double_it_and_lag_stays_bounded():
    work = Workload(group_size=8, calls=20, env_s=0.0, env_sigma=1.0, completion_tokens=1,
                    new_prompt_tokens=0)
    layout = Layout(k=4, gateways=2, max_off_policy_steps=2, policy="windowed_fifo", window=4)
    out = simulate(GATEWAY_ONLY, work, layout, steps=10**6, max_seconds=10.0)
    assert out["calls_per_s"] == pytest.approx(200.0, rel=0.03)
    assert 0 < out["lag_max"] <= 2
