"""The OpenEnv adapter (forgerl/tasks/openenv.py) against environments written to OpenEnv with
its own package (tests/tasks/envs/openenv/guess_env: an MCP environment and an action
environment, served by OpenEnv's create_app from .venv-openenv as real processes on 127.0.0.1),
played by OpenEnv's own client in the adapter's worker: tasks, prompt, tool schemas, per-call
rewards and `done`, a run through the real gateway with a training step, and bad input.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from forgerl.config import ConfigError
from forgerl.controller import start_services
from forgerl.tasks import openenv
from forgerl.tasks.base import EnvironmentError, Step

from ..test_controller import sync, tiny_config
from .conftest import one_step, script_policy

ENVS = Path(__file__).parent / "envs" / "openenv"
needs_venv = pytest.mark.skipif(
    not openenv.VENV_PYTHON.exists(),
    reason=f"no OpenEnv venv at {openenv.VENV_PYTHON} (scripts/setup_openenv.sh builds it)")
PARAMS = {"path": [str(ENVS)]}


def _adapter(location: str, **params) -> openenv.Adapter:
    return openenv.Adapter(location, {**PARAMS, **params}, ENVS)


@pytest.fixture
def echo_server():
    """The action environment served from .venv-openenv, like a remote OpenEnv server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(openenv.VENV_PYTHON), "-m", "uvicorn", "guess_env.server:echo_app", "--host",
         "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env={**os.environ, "PYTHONPATH": str(ENVS)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # importing openenv (gradio) takes 5-25 s here
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and proc.poll() is None, "no echo server"
            time.sleep(0.1)
    yield url, proc
    proc.kill()
    proc.wait()


def test_tasks_are_reset_arguments_listed_or_seeded():
    seeded = _adapter("x:app", reset={"max_tries": 3}).tasks("train", 3, 10)
    assert [t["reset"] for t in seeded] == [{"max_tries": 3, "seed": s} for s in (10, 11, 12)]
    assert seeded[0]["question"] == 'reset {"max_tries": 3, "seed": 10}'
    listed = _adapter("x:app", tasks=[{"seed": 1}, {"seed": 2}], eval_tasks=[{"seed": 9}])
    assert [t["reset"] for t in listed.tasks("train", 3, 0)] == [{"seed": 1}, {"seed": 2},
                                                                 {"seed": 1}]
    assert [t["reset"] for t in listed.tasks("eval", 2, 5)] == [{"seed": 9}, {"seed": 9}]
    with pytest.raises(ConfigError, match=r"^tasks\.params\.tasks: a list of tables"):
        _adapter("x:app", tasks={"seed": 1}).tasks("train", 1, 0)
    with pytest.raises(ConfigError, match=r"^tasks\.params\.eval_tasks: a list of tables"):
        _adapter("x:app", eval_tasks=[]).tasks("eval", 1, 0)


@needs_venv
@sync
async def test_an_mcp_environment_maps_to_prompt_tools_rewards_and_done():
    env = _adapter("guess_env.server:app", system="Use the tools.")
    await env.start()
    try:
        episode = await env.open({"reset": {"seed": 10}})  # secret 3 + 1
        assert episode.prompt == [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Find the secret number: it is 3 + 1. You have 2 "
                                        "guesses."}]
        [tool] = episode.tools
        assert tool["function"]["name"] == "guess"
        assert tool["function"]["description"] == "Guess the secret number."
        assert tool["function"]["parameters"]["properties"] == {"n": {"type": "integer"}}
        assert await episode.call("guess", {"n": 6}) == Step("lower", -0.1, False)
        wrong_name = await episode.call("nope", {})
        assert wrong_name.content.startswith("error:") and wrong_name.reward is None
        bad_args = await episode.call("guess", {"n": "six"})
        assert bad_args.content.startswith("error:") and not bad_args.finished
        assert await episode.call("guess", {"n": 4}) == Step("correct", 1.0, True)
        await episode.close()
        other = await env.open({"reset": {"seed": 0, "max_tries": 1}})  # secret 0, one try
        assert await other.call("guess", {"n": 5}) == Step("lower", 0.0, True)
        await other.close()
    finally:
        await env.stop()
    assert env._server is None and env._worker is None


@needs_venv
@sync
async def test_an_action_environment_is_one_tool_with_the_action_schema(echo_server):
    url, _ = echo_server
    env = _adapter(url)
    await env.start()
    try:
        episode = await env.open({"reset": {"seed": 7}})
        assert episode.prompt == [{"role": "user",
                                   "content": "Say something (seed 7), then say bye."}]
        [tool] = episode.tools
        assert tool["function"]["name"] == "step"
        assert tool["function"]["parameters"]["required"] == ["message"]
        assert await episode.call("step", {"message": "hey"}) == Step("hey", 0.3, False)
        missing = await episode.call("step", {})
        assert missing.content.startswith("error: the environment rejected the action")
        assert await episode.call("step", {"message": "bye"}) == Step("bye", 1.0, True)
        await episode.close()
    finally:
        await env.stop()


@needs_venv
@sync
async def test_a_dead_server_or_missing_venv_or_app_is_said_in_one_line(echo_server, tmp_path):
    url, proc = echo_server
    env = _adapter(url)
    await env.start()
    try:
        proc.kill()
        proc.wait()
        with pytest.raises(EnvironmentError, match=r"^open: .*Error"):
            await env.open({"reset": {}})
        env._worker.kill()  # the worker dies: every later request is an infrastructure failure
        await env._worker.wait()
        with pytest.raises(EnvironmentError, match="OpenEnv worker"):
            await env.open({"reset": {}})
    finally:
        await env.stop()
    with pytest.raises(ConfigError, match=r"^tasks\.env: no OpenEnv server at http://127"):
        await _adapter(url).start()
    with pytest.raises(ConfigError, match=r"^tasks\.env: no OpenEnv server at nowhere:app "
                                          r"\(the server exited"):
        await _adapter("nowhere:app").start()
    with pytest.raises(ConfigError, match=r"^tasks\.python: no OpenEnv venv at /nope"):
        await openenv.Adapter(url, {}, tmp_path, "/nope/python").start()


TRIES: dict[int, int] = {}


def _policy(prompt: str) -> str:
    """Guess one too many first; then the secret on even tries of it, one too few on odd."""
    a, b = map(int, re.findall(r"it is (\d+) \+ (\d+)", prompt)[-1])
    secret = a + b
    if "lower" in prompt:
        TRIES[secret] = TRIES.get(secret, -1) + 1
        n = secret if TRIES[secret] % 2 == 0 else secret - 1
    else:
        n = secret + 1
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"n": {n}}}}}\n</tool_call>'


@pytest.mark.slow
@needs_venv
@sync
async def test_openenv_episodes_train_through_the_gateway(tmp_path):
    config = tiny_config(
        tmp_path / "run", "--tasks.source", "openenv", "--tasks.env", "guess_env.server:app",
        "--tasks.params", f'{{path = ["{ENVS}"]}}', "--tasks.size", "6",
        "--rollout.max_tokens", "96", "--model.max_model_len", "1024")
    async with start_services(config) as s:
        env = s.environments[""]
        assert env.url.startswith("http://127.0.0.1:")
        script_policy(s, _policy)
        s.admit()
        batch = await s.next_batch()
        groups = [s.pool.get_group(i) for i in batch]
        metrics = await s.train(batch)
    assert env._server is None
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 8 and all(t.status == "finished" for t in trajs)
    for t in trajs:
        # turn 0: a wrong guess (process reward -0.1); turn 1: the last guess (the outcome)
        assert len(t.completions) == 2 and t.turn_rewards == [-0.1, 0.0]
    assert {t.reward for t in trajs} == {0.0, 1.0}
    assert metrics["num_loss_tokens"] > 0 and s.trainer.step == 1


@pytest.mark.slow
@needs_venv
@sync
async def test_an_environment_that_dies_mid_run_aborts_its_rollouts(tmp_path, echo_server):
    url, proc = echo_server
    config = tiny_config(tmp_path / "run", "--tasks.source", "openenv", "--tasks.env", url,
                         "--tasks.params", "{}", "--tasks.size", "6", "--rollout.max_tokens", "64",
                         "--model.max_model_len", "1024")
    async with start_services(config) as s:
        proc.kill()
        await asyncio.to_thread(proc.wait)
        script_policy(s, lambda prompt: "hello")
        trajs, metrics = await one_step(s)
    assert {t.status for t in trajs} == {"aborted_infra"}
    assert all("infrastructure: environment open:" in t.error for t in trajs)
    assert metrics["rollouts_aborted_infra"] == 8 and metrics["num_loss_tokens"] == 0
    with pytest.raises(ConfigError, match=r"^tasks\.env: no OpenEnv server at http"):
        async with start_services(config):  # a server that is not there at the start
            pass
