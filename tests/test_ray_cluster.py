"""`[cluster] backend = "ray"` on a two-node Ray cluster made on this machine (issue 13 item 4).

`ray start --head` plus a second `ray start --address` (two raylets = two "nodes"), the tiny
model, 2 engine actors behind the router, 2 trainer ranks (rank 0 in the controller, rank 1 an
actor), the white-box agent over the real gateway. Pins: 3 steps on real recorded groups give
the weights a 1-process trainer gets on the same groups (within 1e-5, fp32); after a checkpoint
and a resume (new actors) one more step still matches; the actors sit on both nodes; weights
reach the engines through one object-store copy (the first sync; later ones as deltas, each
applied and checksummed on both actors); an engine actor killed with SIGKILL fails its
request with a clear RuntimeError, is restarted by Ray and serves the synced version again; a
killed trainer actor stops the step with a RuntimeError naming it. With
`cluster.weight_transport = "broadcast"` one gloo broadcast reaches both engine actors: their
greedy completions equal an in-process engine's on the same weights, a killed actor is restored
to the broadcast version, and the next sync forms the group again with the restarted actor.

Ray binds the machine's own address as well as loopback, so the cluster runs in a private
network namespace (`unshare -n`, loopback only): `test_two_node_cluster` re-runs this module
there and the `test_inner_*` tests run only inside it.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from forgerl.controller import start_services
from forgerl.trainer.data_parallel import build_trainer
from forgerl.types import SamplingParams
from tests.test_controller import make_agent, sync, tiny_config

INSIDE = os.environ.get("FORGERL_RAY_NETNS") == "1"
inner = pytest.mark.runs_in(INSIDE, "test_two_node_cluster's network namespace")
RAY = Path(sys.executable).with_name("ray")


def pytest_in_netns(python: Path | str, path: str, flag: str,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m pytest path -k inner` in a private network namespace (`unshare -n`, loopback
    only), with `flag`=1 and Ray's auth and usage stats off in its environment (plus `env`);
    600 s at most. Skips the calling test where `unshare -n` is not allowed."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode:
        pytest.skip("needs `unshare -n` (util-linux, root) for a private network namespace")
    env = {**os.environ, flag: "1", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           **(env or {})}
    cmd = (f"ip link set lo up && exec {python} -m pytest -rA -s -p no:cacheprovider "
           f"-p no:xdist {path} -k inner")
    return subprocess.run(["unshare", "-n", "sh", "-c", cmd], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).parents[1])


@pytest.mark.runs_in(not INSIDE, "outside the network namespace it makes")
def test_two_node_cluster():
    if not RAY.exists():
        pytest.skip("needs Ray: pip install 'forgerl[ray]'")
    proc = pytest_in_netns(sys.executable, __file__, "FORGERL_RAY_NETNS")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.count("PASSED tests/test_ray_cluster.py::test_inner_") == 4, \
        proc.stdout[-3000:]


@pytest.fixture(scope="module")
def cluster():
    """(address, node ids): a head and a second node, 2 logical CPUs each."""
    temp = tempfile.mkdtemp(prefix="/tmp/frray")  # short: Ray's socket paths are bounded
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "2", "--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    try:
        subprocess.run([RAY, "start", "--head", "--port", str(port), "--temp-dir", temp,
                        "--include-dashboard", "false", *common], check=True, capture_output=True)
        subprocess.run([RAY, "start", "--address", address, *common], check=True,
                       capture_output=True)
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)


def _config(run_dir, address, *extra):
    return tiny_config(run_dir, "--trainer.workers", "2", "--trainer.max_row_tokens", "128",
                       "--model.max_model_len", "128", "--rollout.tasks_per_step", "4",
                       "--trainer.device", "cpu", "--tasks.eval_size", "0",
                       "--engine.instances", "2", "--cluster.backend", "ray",
                       "--cluster.address", address, "--cluster.placement", "SPREAD", *extra)


async def _step_against_reference(s, reference):
    s.admit()
    batch = await s.next_batch()
    groups = [s.pool.get_group(i) for i in batch]
    want = reference.train_step(groups)
    got = await s.train(batch)
    assert got["num_loss_tokens"] == want["num_loss_tokens"] > 0
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    ref = dict(reference.model.named_parameters())
    for name, p in s.trainer.model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=0, atol=1e-5)
    await s.sync_weights()
    versions = {c.weight_version for g in groups for t in g.trajectories for c in t.completions}
    return versions


@inner
@sync
async def test_inner_ray_run_trains_like_one_process_and_resumes(tmp_path, cluster):
    import ray

    from forgerl import cluster as cl

    run_dir = tmp_path / "run"
    # lag <= 1: step 3's tasks are admitted after step 1, so they run on synced weights (at the
    # default lag 2 all 12 tasks of 3 steps start at version 0)
    config = _config(run_dir, cluster, "--trainer.weight_sync", "delta",
                     "--scheduler.max_off_policy_steps", "1")
    async with start_services(config, make_agent()) as s:
        engines = s.engine.instances
        nodes = {e.node_id for e in engines}
        assert len(nodes) == 2  # SPREAD put the two engine actors on the two nodes
        assert all(e.weight_version == 0 for e in engines)
        reference = build_trainer(_config(run_dir, cluster, "--trainer.workers", "1"),
                                  copy.deepcopy(s.trainer.model))
        seen, kinds = set(), []
        for step in range(3):
            seen |= await _step_against_reference(s, reference)
            assert [e.weight_version for e in engines] == [step + 1] * 2
            assert not cl._PUTS  # the shared object-store copy was released after the sync
            kinds.append(s.weight_sync.stats["kind"])
        assert max(seen) >= 1  # later rollouts ran on the weights synced to the actors
        assert kinds == ["full", "delta", "delta"]  # both actors took each delta (checksummed)
        await s.checkpoint()
        assert ray.is_initialized()
    async with start_services(config, make_agent()) as s:  # new actors, resumed from step 3
        assert s.trainer.step == 3
        assert [e.weight_version for e in s.engine.instances] == [3, 3]
        await _step_against_reference(s, reference)


@inner
@sync
async def test_inner_killed_engine_actor_fails_its_request_and_comes_back(tmp_path, cluster):
    async with start_services(_config(tmp_path / "run", cluster, "--engine.instances", "1"),
                              make_agent()) as s:
        engine = s.engine
        await engine.update_weights(s.trainer.state_dict_for_sync(), 7)  # kept for a restart
        params = SamplingParams(temperature=1.0, max_tokens=64, seed=1)
        stream = engine.stream([1, 2, 3], params)
        await anext(stream)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"engine actor .* died"):
            async for _ in stream:
                pass
        deadline = time.monotonic() + 120
        while True:  # Ray restarts the actor; the first request restores the synced weights
            try:
                out = await engine.generate([1, 2, 3], params)
                break
            except RuntimeError:
                assert time.monotonic() < deadline
        assert out.weight_versions and set(out.weight_versions) == {7}
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.generate([1] * 127, params)
        with pytest.raises(ValueError) as bad:  # the actor's own error, without Ray's trace
            await engine.generate([1, 10**6], params)
        assert type(bad.value) is ValueError and "ray::" not in str(bad.value)


@inner
@sync
async def test_inner_killed_trainer_actor_stops_the_step(tmp_path, cluster):
    async with start_services(_config(tmp_path / "run", cluster), make_agent()) as s:
        [pid] = s.trainer.workers.pids
        os.kill(pid, signal.SIGKILL)
        s.admit()
        batch = await s.next_batch()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="trainer worker 1"):
            await s.train(batch)
        assert time.monotonic() - start < 60


@inner
@sync
async def test_inner_broadcast_sync_reaches_every_engine_and_survives_a_restart(tmp_path,
                                                                               cluster):
    from forgerl.engines.local import LocalEngine

    config = _config(tmp_path / "run", cluster, "--trainer.workers", "1",
                     "--cluster.weight_transport", "broadcast")
    async with start_services(config, make_agent()) as s:
        engines, bcast = s.engine.instances, s.engine.instances[0].broadcast
        assert bcast is not None and bcast.backend == "gloo" and bcast.epoch == 1
        params = SamplingParams(temperature=0.0, max_tokens=12)

        async def check(version: int, scale: float) -> None:
            weights = {k: v.detach() * scale for k, v in s.trainer.state_dict_for_sync().items()}
            await s.engine.update_weights(weights, version)
            assert [e.weight_version for e in engines] == [version] * 2
            local = LocalEngine(s.trainer.model, max_model_len=128)
            await local.update_weights(weights, version)
            want = (await local.generate([1, 2, 3], params)).completion_ids
            await local.close()
            for e in engines:
                out = await e.generate([1, 2, 3], params)
                assert out.completion_ids == want and set(out.weight_versions) == {version}

        await check(5, 1.5)
        assert bcast.epoch == 1  # the group formed at start served both syncs
        os.kill(engines[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # restarted by Ray; its first request restores the last broadcast weights
            try:
                out = await engines[0].generate([1, 2, 3], params)
                break
            except RuntimeError:
                assert time.monotonic() < deadline
        assert set(out.weight_versions) == {5}
        await check(6, 0.5)  # the restarted actor joined a new group
        assert bcast.epoch == 2
