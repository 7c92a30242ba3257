"""The Gymnasium adapter (forgerl/tasks/gymnasium.py) with a text environment written to the
standard and registered with gymnasium.register (tests/tasks/envs/gymnasium/guess.py): tasks as
reset seeds, the observation as the prompt, the `step` tool checked against Text and Discrete
action spaces, step rewards as process rewards, the terminal reward as the outcome, a training
step; a missing environment is a one-line ConfigError."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from forgerl.config import ConfigError
from forgerl.controller import make_task_sets, start_services
from forgerl.tasks.base import Step

from ..test_controller import sync, tiny_config
from .conftest import one_step, script_policy

pytest.importorskip("gymnasium", reason="the gymnasium extra is not installed")
from forgerl.tasks.gymnasium import Adapter

GUESS = str(Path(__file__).parent / "envs" / "gymnasium" / "guess.py")
ENV_ID = "forgerl-test/GuessNumber-v0"


def _adapter(**params) -> Adapter:
    return Adapter(ENV_ID, {"module": GUESS, **params}, Path.cwd())


def test_tasks_are_reset_seeds_with_the_first_observation():
    tasks = _adapter().tasks("train", 3, 0)
    assert tasks == [
        {"question": f"{ENV_ID} seed 0: Guess my number: it is 16 or 17.", "seed": 0},
        {"question": f"{ENV_ID} seed 1: Guess my number: it is 9 or 10.", "seed": 1},
        {"question": f"{ENV_ID} seed 2: Guess my number: it is 16 or 17.", "seed": 2}]


def test_text_actions_step_the_environment_and_bad_ones_are_the_policys_mistake():
    async def main():
        episode = await _adapter().open({"seed": 1})
        assert episode.prompt == [{"role": "user", "content": "Guess my number: it is 9 or 10."}]
        [tool] = episode.tools
        assert tool["function"]["name"] == "step"
        assert tool["function"]["parameters"]["properties"]["action"] == {
            "type": "string", "minLength": 1, "maxLength": 2, "description": "the action, as text"}
        bad = await episode.call("step", {"action": "nine"})
        assert bad.reward is None and not bad.finished and "not in the action space" in bad.content
        assert (await episode.call("step", {"action": 9})).content == \
            "error: action must be a string, not 9"
        assert (await episode.call("move", {})).content == \
            "error: this environment has no tool 'move'"
        assert await episode.call("step", {"action": "10"}) == Step("lower", -0.1, False)
        last = await episode.call("step", {"action": "9"})
        assert (last.content, last.reward, last.finished) == ("Right!", 1.0, True)
        episode.final_reward = last.reward
        assert await episode.score("", []) == 1.0
        await episode.close()

    asyncio.run(main())


def test_discrete_actions_are_integers_in_range_and_truncation_finishes():
    async def main():
        episode = await _adapter(actions="discrete").open({"seed": 1})
        action = episode.tools[0]["function"]["parameters"]["properties"]["action"]
        assert (action["type"], action["minimum"], action["maximum"]) == ("integer", 1, 20)
        assert (await episode.call("step", {"action": 21})).content == \
            "error: action 21 is not in 1..20"
        assert (await episode.call("step", {"action": True})).content == \
            "error: action must be an integer, not true"
        first = await episode.call("step", {"action": 3})
        assert (first.content, first.reward, first.finished) == ("higher", -0.1, False)
        second = await episode.call("step", {"action": "4"})  # the TimeLimit of 2 steps
        assert (second.content, second.reward, second.finished) == ("higher", -0.1, True)
        await episode.close()

    asyncio.run(main())


def _config(tmp_path, *extra, env=ENV_ID, params=f'{{module = "{GUESS}"}}'):
    return tiny_config(tmp_path / "run", "--tasks.source", "gymnasium", "--tasks.env", env,
                       "--tasks.params", params, "--tasks.size", "6",
                       "--rollout.max_tokens", "96", "--model.max_model_len", "1024", *extra)


def test_a_missing_environment_or_unsupported_space_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"tasks\.env: gymnasium cannot make 'forgerl-test/No"):
        make_task_sets(_config(tmp_path, env="forgerl-test/Nope-v0"))
    with pytest.raises(ConfigError, match=r"params\.module: no file /nonexistent/x\.py") as e:
        make_task_sets(_config(tmp_path, params='{module = "/nonexistent/x.py"}'))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"action space Box.* is not supported"):
        make_task_sets(_config(tmp_path, env="MountainCarContinuous-v0", params="{}"))


TRIES: dict[int, int] = {}


def _policy(prompt: str) -> str:
    """Guess the lower number (right) on even tries of a task, the higher one twice on odd tries
    (wrong, then truncated)."""
    low = int(re.findall(r"it is (\d+) or", prompt)[-1])
    if "lower" not in prompt:
        TRIES[low] = TRIES.get(low, -1) + 1
    guess = low if TRIES[low] % 2 == 0 else low + 1
    return f'<tool_call>\n{{"name": "step", "arguments": {{"action": "{guess}"}}}}\n</tool_call>'


@pytest.mark.slow
@sync
async def test_gymnasium_episodes_train_through_the_gateway(tmp_path):
    train, held = make_task_sets(_config(tmp_path))
    assert [t["seed"] for t in train] == [0, 1, 2, 3, 4, 5]
    assert [t["seed"] for t in held] == [1_000_003, 1_000_004]
    async with start_services(_config(tmp_path)) as s:
        script_policy(s, _policy)
        trajs, metrics = await one_step(s)
    assert len(trajs) == 8 and {t.status for t in trajs} == {"finished"}
    right = [t for t in trajs if t.reward == 1.0]
    wrong = [t for t in trajs if t.reward != 1.0]
    assert right and wrong
    for t in right:  # one guess, the terminal step: the outcome, no process reward
        assert len(t.completions) == 1 and t.turn_rewards is None
    for t in wrong:  # a wrong guess (-0.1 on turn 0), then truncated: -0.1 is the outcome
        assert len(t.completions) == 2 and t.turn_rewards == [-0.1, 0.0]
        assert t.reward == pytest.approx(-0.1)
    assert metrics["num_loss_tokens"] > 0 and s.trainer.step == 1
