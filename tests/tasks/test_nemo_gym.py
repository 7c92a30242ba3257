"""The NeMo-Gym adapter (forgerl/tasks/nemo_gym.py) against a resources server written here in
NeMo-Gym's format (tests/tasks/envs/nemo_gym/app.py, served over real HTTP by uvicorn): tasks
from its JSONL, the prompt and tools from responses_create_params, tool calls posted to its
endpoints within the seeded session, /verify's reward as the outcome, a training step; a
server that cannot be reached or masks the sample is an infrastructure abort."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from forgerl.config import ConfigError
from forgerl.controller import make_task_sets, start_services
from forgerl.tasks.base import EnvironmentError, Step
from forgerl.tasks.nemo_gym import Adapter

from ..test_controller import sync, tiny_config
from .conftest import one_step, script_policy
from .envs.nemo_gym import app as server

DATA = Path(__file__).parent / "envs" / "nemo_gym"
PARAMS = {"dataset": str(DATA / "train.jsonl"), "eval_dataset": str(DATA / "eval.jsonl")}


@pytest.fixture(scope="module")
def url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    running = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port,
                                            log_level="warning"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)


def test_tasks_are_the_jsonl_rows_shuffled_by_seed():
    adapter = Adapter("http://127.0.0.1:9", PARAMS, Path.cwd())
    train = adapter.tasks("train", 10, 0)
    assert len(train) == 6 and train[0]["row"]["initial_count"] == 2
    assert train[0]["question"] == "The counter starts at 2. Make it 8, then say done."
    assert [t["row"]["expected_count"] for t in adapter.tasks("eval", 1, 0)] in ([4], [11])
    assert [t["question"] for t in adapter.tasks("train", 6, 0)] == \
        [t["question"] for t in train]


def test_an_episode_seeds_a_session_calls_tools_and_is_verified(url):
    async def main():
        adapter = Adapter(url, PARAMS, Path.cwd())
        task = adapter.tasks("train", 1, 0)[0]  # from 2 to 8
        episode = await adapter.open(task)
        assert episode.prompt == [
            {"role": "system", "content": "You operate a counter with tools."},
            {"role": "user", "content": "The counter starts at 2. Make it 8, then say done."}]
        assert [t["function"]["name"] for t in episode.tools] == \
            ["increment_counter", "get_counter_value"]
        assert episode.tools[0]["function"]["parameters"]["properties"] == \
            {"count": {"type": "integer"}}
        assert await episode.call("increment_counter", {"count": 6}) == Step('{"success":true}')
        assert await episode.call("get_counter_value", {}) == Step('{"count":8}')
        bad = await episode.call("increment_counter", {"count": "six"})
        assert "int_parsing" in bad.content and bad.reward is None  # the server's 422, said
        assert (await episode.call("reset", {})).content == \
            "error: this environment has no tool 'reset'"
        call = {"id": "call_1", "type": "function",
                "function": {"name": "increment_counter", "arguments": '{"count": 6}'}}
        messages = [*episode.prompt, {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"success":true}'},
                    {"role": "assistant", "content": "done"}]
        assert await episode.score("done", messages) == 1.0
        verified = server.VERIFIED[-1]
        assert [item.type for item in verified.response.output] == \
            ["function_call", "function_call_output", "message"]
        assert verified.response.output[0].arguments == '{"count": 6}'
        assert verified.response.output[2].content[0].text == "done"
        assert verified.expected_count == 8
        await episode.close()
        other = await adapter.open(task)  # a new session: the counter starts again
        assert await other.call("get_counter_value", {}) == Step('{"count":2}')
        assert await other.score(None, other.prompt) == 0.0
        await other.close()

    asyncio.run(main())


def test_a_masked_sample_and_an_unreachable_server_are_infrastructure_failures(url):
    async def main():
        task = Adapter(url, PARAMS, Path.cwd()).tasks("train", 1, 0)[0]
        masked = {**task, "row": {**task["row"], "mask": True}}
        episode = await Adapter(url, PARAMS, Path.cwd()).open(masked)
        with pytest.raises(EnvironmentError, match="masked the sample: resources_unavailable"):
            await episode.score("done", episode.prompt)
        await episode.close()
        unverifiable = {**task, "row": {k: v for k, v in task["row"].items()
                                        if k != "expected_count"}}
        episode = await Adapter(url, PARAMS, Path.cwd()).open(unverifiable)
        with pytest.raises(EnvironmentError, match=r"/verify: 422 .*expected_count"):
            await episode.score("done", episode.prompt)
        await episode.close()
        with pytest.raises(EnvironmentError, match=r"127\.0\.0\.1:9/seed_session: ConnectError"):
            await Adapter("http://127.0.0.1:9", PARAMS, Path.cwd()).open(task)

    asyncio.run(main())


def _config(tmp_path, *extra, env="http://127.0.0.1:9", params=None):
    params = params or f'{{dataset = "{PARAMS["dataset"]}", eval_dataset = ' \
        f'"{PARAMS["eval_dataset"]}"}}'
    return tiny_config(tmp_path / "run", "--tasks.source", "nemo_gym", "--tasks.env", env,
                       "--tasks.params", params, "--tasks.size", "6",
                       "--rollout.max_tokens", "96", "--model.max_model_len", "1024", *extra)


def test_a_missing_dataset_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^tasks\.params\.dataset: required") as e:
        make_task_sets(_config(tmp_path, params="{}"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^tasks\.params: unknown keys \['timeout'\] for "
                                          r"source 'nemo_gym' \(it reads dataset, eval_dataset"):
        make_task_sets(_config(tmp_path, params=f'{{dataset = "{PARAMS["dataset"]}", '
                                                f'timeout = 5}}'))  # a typo of timeout_s
    with pytest.raises(ConfigError, match=r"params\.eval_dataset: required .*eval_size = 0"):
        make_task_sets(_config(tmp_path, params=f'{{dataset = "{PARAMS["dataset"]}"}}'))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"responses_create_params": {"input": "hi", "tools": [{"type": '
                   '"web_search"}]}}\n')
    with pytest.raises(ConfigError, match=r"line 1: .*'web_search' tools are not supported"):
        make_task_sets(_config(tmp_path, "--tasks.eval_size", "0",
                               params=f'{{dataset = "{bad}"}}'))
    for row, message in [('{"oops"', "line 2: not JSON (Expecting ':'"),
                         ("[1]", "line 2: not an object with responses_create_params")]:
        bad.write_text(f'{{"responses_create_params": {{"input": "hi"}}}}\n{row}\n')
        with pytest.raises(ConfigError, match=rf"^tasks\.params\.dataset: {bad} "
                                              rf"{re.escape(message)}") as e:
            make_task_sets(_config(tmp_path, "--tasks.eval_size", "0",
                                   params=f'{{dataset = "{bad}"}}'))
        assert "\n" not in str(e.value)


TRIES: dict[str, int] = {}


def _policy(prompt: str) -> str:
    """Increment by the difference on even tries of a task, by 1 on odd ones; then say done."""
    start, goal = map(int, re.findall(r"starts at (\d+)\. Make it (\d+)", prompt)[-1])
    if "success" in prompt:
        return "done"
    key = f"{start}-{goal}"
    TRIES[key] = TRIES.get(key, -1) + 1
    n = goal - start if TRIES[key] % 2 == 0 else 1 + goal - start
    return f'<tool_call>\n{{"name": "increment_counter", "arguments": {{"count": {n}}}}}' \
        '\n</tool_call>'


@pytest.mark.slow
@sync
async def test_nemo_gym_episodes_train_through_the_gateway(tmp_path, url):
    async with start_services(_config(tmp_path, env=url)) as s:
        script_policy(s, _policy)
        trajs, metrics = await one_step(s)
    assert len(trajs) == 8 and {t.status for t in trajs} == {"finished"}
    assert {t.reward for t in trajs} == {0.0, 1.0}
    for t in trajs:  # the tool call, then "done"; no per-call rewards in NeMo-Gym
        assert len(t.completions) == 2 and t.turn_rewards is None
    assert metrics["num_loss_tokens"] > 0 and s.trainer.step == 1


@pytest.mark.slow
@sync
async def test_a_resources_server_down_at_the_start_is_a_config_error(tmp_path):
    """Down at the start: the run does not start (a one-line error naming tasks.env); one that
    goes away later aborts rollouts as infrastructure (the adapter test above)."""
    with pytest.raises(ConfigError, match=r"^tasks\.env: no NeMo-Gym resources server at "
                                          r"http://127\.0\.0\.1:9 \(ConnectError") as e:
        async with start_services(_config(tmp_path)):
            pass
    assert "\n" not in str(e.value)
