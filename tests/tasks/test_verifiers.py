"""The verifiers source (forgerl/tasks/verifiers.py) on verifiers 0.4.0 itself, in its own venv
(.venv-verifiers, scripts/setup_verifiers.sh), with two environments written here in verifiers'
v1 format and installed there (tests/tasks/envs/verifiers/): vf-arith, single-turn with two
weighted rewards, and vf-calc, a calculator Toolset whose tools update rollout state and a rubric
that rewards the answer and the tool's use. End to end: rollouts through the real gateway, the
rubric's reward in the pool, a training step; a missing environment, a missing venv and a dead
worker.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from forgerl.config import ConfigError
from forgerl.controller import make_task_sets, start_services
from forgerl.tasks.base import EnvironmentError
from forgerl.tasks.episode import run_episode
from forgerl.tasks.verifiers import VENV_PYTHON, Adapter

from ..test_controller import sync, tiny_config
from .conftest import script_policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VENV_PYTHON.exists(), reason="no .venv-verifiers: verifiers pins "
                       "mcp==2.0 and openai<3, so it lives in its own venv; run "
                       "scripts/setup_verifiers.sh"),
]
HERE = Path(__file__).parent


def _tool(name: str, description: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "title": f"{name[5:]}Arguments",
                           "required": ["a", "b"], "properties": {
                               "a": {"title": "A", "type": "integer"},
                               "b": {"title": "B", "type": "integer"}}}}}


def test_tasks_are_the_tasksets_rows_with_every_tenth_held_out():
    arith = Adapter("vf-arith", {"num_tasks": 20}, HERE)
    train = arith.tasks("train", 100, 0)
    held = Adapter("envs/verifiers/vf_arith", {"num_tasks": 20}, HERE).tasks("eval", 100, 0)
    assert sorted(t["vf_data"]["idx"] for t in held) == [0, 10]
    assert sorted(t["vf_data"]["idx"] for t in train) == [i for i in range(20) if i % 10]
    assert [t["vf_data"]["idx"] for t in train] != sorted(t["vf_data"]["idx"] for t in train)
    for t in train + held:  # the prompt text is the question; the row's own fields ride along
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Answer with the number only\.",
                                     t["question"]).groups())
        assert t["vf_data"]["answer"] == a + b and t["vf_type"] == "ArithTask"
    chosen = Adapter("vf-arith", {"num_tasks": 20, "select": {"include": {"idx": "3:6"}}},
                     HERE).tasks("train", 2, 0)
    assert len(chosen) == 2 and {t["vf_data"]["idx"] for t in chosen} <= {3, 4, 5}


@sync
async def test_episodes_serve_the_toolsets_tools_and_score_with_the_rubric():
    calc, arith = Adapter("vf-calc", {}, HERE), Adapter("vf-arith", {}, HERE)
    await asyncio.gather(calc.start(), arith.start())
    try:
        task = {"question": "q", "vf_data": {"prompt": "Compute (2 + 3) * 4.", "answer": 20}}
        episode = await calc.open(task)
        assert episode.prompt == [{"role": "user", "content": "Compute (2 + 3) * 4."}]
        assert episode.tools == [_tool("calc_add", "Add two integers."),
                                 _tool("calc_multiply", "Multiply two integers.")]
        first = await episode.call("calc_add", {"a": 2, "b": 3})
        assert (first.content, first.reward, first.finished) == ("5", None, False)
        assert (await episode.call("calc_multiply", {"a": 5, "b": 4})).content == "20"
        bad = await episode.call("calc_add", {"a": "two", "b": 3})
        assert bad.content.startswith("error: ") and "valid integer" in bad.content
        assert (await episode.call("calc_divide", {})).content == \
            "error: this environment has no tool 'calc_divide'"
        call = {"id": "c1", "type": "function",
                "function": {"name": "calc_add", "arguments": '{"a": 2, "b": 3}'}}
        talk = [*episode.prompt, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
        scored = await calc.request("score", episode=episode.episode,
                                    messages=[*talk, {"role": "assistant", "content": "20"}])
        # correct (weight 1) + used_calculator (weight 0.25); the tools' state reached the task
        assert scored == {"reward": 1.25, "rewards": {"correct": 1.0, "used_calculator": 0.25},
                          "metrics": {"tool_calls": 2.0}}
        no_tool = [*episode.prompt, {"role": "assistant", "content": "21"}]
        assert await episode.score("21", no_tool) == 0.0
        await episode.close()

        sums = await arith.open({"vf_data": {"prompt": "What is 2 + 3?", "answer": 5,
                                             "system_prompt": "Be exact."}})
        assert sums.prompt == [{"role": "system", "content": "Be exact."},
                               {"role": "user", "content": "What is 2 + 3?"}]
        assert sums.tools == []
        rewards = [await sums.score(reply, [*sums.prompt, {"role": "assistant",
                                                           "content": reply}])
                   for reply in ("5", "6", "It is 5.")]
        assert rewards == [1.5, 0.5, 0.0]  # exact (1) + digits_only (0.5)
    finally:
        await asyncio.gather(calc.stop(), arith.stop())


TRIES: dict[str, int] = {}


def _calculator_policy(prompt: str) -> str:
    """add, multiply, then the product; every other try of a task answers one more (wrong)."""
    at = prompt.rindex("Compute (")
    a, b, c = map(int, re.match(r"Compute \((\d+) \+ (\d+)\) \* (\d+)", prompt[at:]).groups())
    done = prompt[at:].count("<tool_response>")
    if done == 0:
        return f'<tool_call>\n{{"name": "calc_add", "arguments": {{"a": {a}, "b": {b}}}}}\n' \
               "</tool_call>"
    if done == 1:
        return f'<tool_call>\n{{"name": "calc_multiply", "arguments": {{"a": {a + b}, ' \
               f'"b": {c}}}}}\n</tool_call>'
    key = prompt[at:at + 40]
    TRIES[key] = TRIES.get(key, -1) + 1
    return f"The result is {(a + b) * c + TRIES[key] % 2}."


def _config(tmp_path, *extra):
    return tiny_config(tmp_path / "run", "--tasks.source", "verifiers", "--tasks.env", "vf-calc",
                       "--tasks.params", "{num_tasks = 12}", "--tasks.size", "6",
                       "--rollout.max_tokens", "96", "--model.max_model_len", "2048", *extra)


@sync
async def test_calculator_rollouts_through_the_gateway_are_scored_by_the_rubric_and_train(
        tmp_path):
    async with start_services(_config(tmp_path)) as s:
        script_policy(s, _calculator_policy)
        s.admit()
        batch = await s.next_batch()
        groups = [s.pool.get_group(i) for i in batch]
        metrics = await s.train(batch)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 8 and all(t.status == "finished" for t in trajs)
    for t in trajs:  # add, multiply, answer: three recorded turns; no per-call rewards
        assert len(t.completions) == 3 and t.turn_rewards is None
    # the rubric: correct (1.0) + used_calculator (0.25), or the tool's share alone
    assert {t.reward for t in trajs} == {1.25, 0.25}
    assert metrics["num_loss_tokens"] > 0 and s.trainer.step == 1


def test_a_missing_environment_or_venv_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^tasks\.env: verifiers: ModuleNotFoundError: "
                       r"taskset 'vf-nowhere' not found") as e:
        make_task_sets(_config(tmp_path, "--tasks.env", "vf-nowhere"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"ValidationError: 1 validation error for \w+; "
                       r"nonsense; Extra inputs are not permitted") as e:  # names the field
        make_task_sets(_config(tmp_path, "--tasks.params", "{nonsense = 3}"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"tasks\.env: no verifiers venv at /nowhere/python: "
                       r"run scripts/setup_verifiers\.sh"):
        make_task_sets(_config(tmp_path, "--tasks.python", "/nowhere/python"))


@sync
async def test_a_dead_worker_is_an_infrastructure_abort():
    calc = Adapter("vf-calc", {}, HERE)
    await calc.start()
    task = {"question": "q", "vf_data": {"prompt": "Compute (2 + 3) * 4.", "answer": 20}}

    async def play(episode):
        calc._proc.kill()  # the worker dies mid-episode
        await episode.call("calc_add", {"a": 2, "b": 3})

    try:
        outcome = await run_episode(calc, task, play, None, lambda: 1)  # type: ignore[arg-type]
        assert outcome.status == "aborted_infra"
        assert "verifiers worker exited (status -9)" in outcome.error
        with pytest.raises(EnvironmentError, match="worker exited"):
            await calc.open(task)
    finally:
        await calc.stop()
