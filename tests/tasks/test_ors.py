"""The Open Reward Standard adapter (forgerl/tasks/ors.py) against a real ORS server: the
calculator environment of examples/ors_calculator/, written with ors-sdk's server side and served
by uvicorn on 127.0.0.1 in a child process. Tasks, the prompt, the tool schemas, each call's
reward and `finished`, the end-to-end run through the gateway (process rewards on the calling
turn, the outcome, a training step), and what an unreachable or vanishing server gives.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ors", reason="ors-sdk is ForgeRL's 'ors' extra: pip install -e '.[ors]'")

from forgerl.config import ConfigError
from forgerl.controller import make_task_sets, start_services
from forgerl.tasks.base import EnvironmentError
from forgerl.tasks.ors import Adapter

from ..test_controller import sync, tiny_config
from .conftest import one_step, script_policy

pytestmark = pytest.mark.slow
SERVER = Path(__file__).parents[2] / "examples" / "ors_calculator" / "server.py"
PARAMS = '{environment = "calculator"}'


def serve() -> tuple[subprocess.Popen, str]:
    """The calculator ORS server on a free port; (process, base URL) once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ORS_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the ORS calculator server did not start")


@pytest.fixture(scope="module")
def server():
    proc, url = serve()
    yield url
    proc.kill()
    proc.wait()


def _adapter(url, **params):
    return Adapter(url, {"environment": "calculator", **params}, Path.cwd())


def test_tasks_are_the_servers_splits_sampled_by_seed(server):
    train = _adapter(server).tasks("train", 5, 0)
    assert len(train) == 5 and train == _adapter(server).tasks("train", 5, 0)
    assert train != _adapter(server).tasks("train", 5, 1)
    for task in train:
        terms = [int(x) for x in re.findall(r"\d+", task["question"])]
        assert task["task_spec"] == {"question": task["question"], "answer": str(sum(terms))}
        assert task["ors_env"] == "calculator" and task["split"] == "train"
        assert 0 <= task["index"] < 2_000
    held = _adapter(server).tasks("eval", 1_000, 0)  # the "test" split has 200
    assert len(held) == 200 and {t["split"] for t in held} == {"test"}
    renamed = _adapter(server, eval_split="train").tasks("eval", 3, 0)
    assert {t["split"] for t in renamed} == {"train"}


def test_an_episode_maps_prompt_tools_rewards_and_finished(server):
    adapter = _adapter(server)
    asyncio.run(_episode(adapter, adapter.tasks("train", 1, 0)[0]))  # tasks(): no loop running


async def _episode(adapter, task):
    await adapter.start()
    episode = await adapter.open(task)
    assert episode.prompt == [{"role": "user", "content": task["question"] +
                               " Use the calculate tool, then submit the answer."}]
    assert episode.tools[0] == {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {
            "expression": {"type": "string",
                           "description": "An arithmetic expression, e.g. 123 + 456"}}}}}
    assert [t["function"]["name"] for t in episode.tools] == ["calculate", "submit"]
    expression = task["question"].removeprefix("What is ").removesuffix("?")
    step = await episode.call("calculate", {"expression": expression})
    assert (step.content, step.reward, step.finished) == (task["task_spec"]["answer"], 0.1, False)
    step = await episode.call("calculate", {"expression": "2 * (3 + 4)"})
    assert (step.content, step.reward) == ("14", 0.0)
    step = await episode.call("calculate", {"expression": "__import__('os')"})
    assert step.content.startswith("error: only numbers") and not step.finished
    # the policy's mistakes: the step says so, the session goes on
    step = await episode.call("divide", {})
    assert (step.content, step.reward) == ("error: 'divide' is not a valid tool", None)
    step = await episode.call("submit", {"value": 1})
    assert step.content.startswith("error: Tool input validation error")
    assert "'loc': ('answer',)" in step.content
    step = await episode.call("submit", {"answer": "1"})
    assert (step.content, step.reward, step.finished) == ("incorrect", 0.0, True)
    episode.final_reward = step.reward
    assert await episode.score(None, []) == 0.0
    await episode.close()
    with pytest.raises(EnvironmentError, match="ORS server"):  # the session is gone
        await episode.call("submit", {"answer": task["task_spec"]["answer"]})
    await adapter.stop()
    gone = _adapter("http://127.0.0.1:9")
    with pytest.raises(EnvironmentError, match=r"^ORS server http://127.0.0.1:9: MaxRetriesError"):
        await gone.open(task)  # no server: an infrastructure failure, never a traceback
    await gone.stop()


def _config(tmp_path, url, *extra):
    return tiny_config(tmp_path / "run", "--tasks.source", "ors", "--tasks.env", url,
                       "--tasks.params", PARAMS, "--tasks.size", "6", "--rollout.max_tokens",
                       "160", "--model.max_model_len", "2048", *extra)


def test_bad_locations_are_one_line_config_errors(tmp_path, server):
    with pytest.raises(ConfigError, match=r"^tasks\.env: ORS server http://127.0.0.1:9, "
                       r"environment 'calculator', split 'test': MaxRetriesError") as e:
        make_task_sets(_config(tmp_path, "http://127.0.0.1:9"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^tasks\.env: .*environment 'nope'.*404"):
        make_task_sets(_config(tmp_path, server, "--tasks.params", '{environment = "nope"}'))
    with pytest.raises(ConfigError, match=r"^tasks\.env: .*split 'dev': .*400.*'Invalid split'"):
        make_task_sets(_config(tmp_path, server, "--tasks.params",
                               '{environment = "calculator", eval_split = "dev"}'))
    with pytest.raises(ConfigError, match=r"^tasks\.params: environment: required"):
        make_task_sets(_config(tmp_path, server, "--tasks.params", "{}"))
    train, held = make_task_sets(_config(tmp_path, server))
    assert len(train) == 6 and len(held) == 2 and {t["split"] for t in held} == {"test"}


TRIES: dict[str, int] = {}


def _policy(prompt: str) -> str:
    """Calculate the sum on even tries of a question and a wrong one on odd ones, then submit
    the value the calculator returned (the last number of the prompt)."""
    question = re.findall(r"What is ([\d + ]+)\?", prompt)[-1]
    if "<tool_response>" in prompt:
        value = re.findall(r"\d+", prompt)[-1]
        call = f'{{"name": "submit", "arguments": {{"answer": "{value}"}}}}'
        return f"<tool_call>\n{call}\n</tool_call>"
    TRIES[question] = TRIES.get(question, -1) + 1
    expression = question if TRIES[question] % 2 == 0 else "1 + 1"
    return ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "'
            f'{expression}"}}}}\n</tool_call>')


@sync
async def test_rollouts_through_the_gateway_carry_the_servers_rewards_and_train(tmp_path, server):
    async with start_services(_config(tmp_path, server)) as s:
        script_policy(s, _policy)
        trajs, metrics = await one_step(s)
    assert len(trajs) == 8 and {t.status for t in trajs} == {"finished"}
    for t in trajs:  # turn 0 calculated (a process reward), turn 1 submitted (the outcome)
        assert len(t.completions) == 2
        assert (t.turn_rewards, t.reward) in (([0.1, 0.0], 1.0), ([0.0, 0.0], 0.0))
    assert {t.reward for t in trajs} == {0.0, 1.0}
    assert metrics["num_loss_tokens"] > 0 and s.trainer.step == 1


@sync
async def test_a_server_that_goes_away_mid_run_aborts_its_rollouts(tmp_path):
    proc, url = serve()
    killed = []

    def policy(prompt: str) -> str:
        if not killed:  # the server dies before the first tool call (on a busy machine some
            # rollouts are still opening their episode then: they fail at the open instead)
            proc.kill()
            proc.wait()
            killed.append(True)
        return _policy(prompt)

    try:
        async with start_services(_config(tmp_path, url)) as s:
            script_policy(s, policy)
            s.admit()
            batch = await asyncio.wait_for(s.next_batch(), 120)
            trajs = [t for i in batch for t in s.pool.get_group(i).trajectories]
            metrics = await s.train(batch)
    finally:
        proc.kill()
    assert {t.status for t in trajs} == {"aborted_infra"}
    assert all(re.match(rf"infrastructure: environment ORS server {url}: ", t.error)
               for t in trajs), [t.error for t in trajs]
    assert any(re.match(rf"infrastructure: environment ORS server {url}: tool 'calculate': ",
                        t.error) for t in trajs)
    assert metrics["rollouts_aborted_infra"] == 8 and metrics["num_loss_tokens"] == 0
