"""The [warmstart] phase: demonstrations → token-exact SFT samples → NLL steps before RL.

Pins: a record trains exactly the ids the model samples for each assistant message (the
rendered reply and its end-of-turn id), never a weight-0 message or the turns around it; the
supervised step's loss and gradients equal a naive per-sample NLL on the unpacked sequences;
bad files are refused with the file and line named; a run takes its warm-start steps first
(logged as phase "warmstart", evaluated and checkpointed at the end) and does not redo them
when it resumes.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest
import torch

from forgerl.config import ConfigError, load_config
from forgerl.controller.warmstart import demo_sample, load_demos, step_records
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.models import build_tiny_model
from forgerl.trainer.losses import nll_loss
from forgerl.trainer.trainer import Trainer

CALC = {"type": "function", "function": {
    "name": "calc", "description": "add", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}


def _record(reply: str = "2") -> dict:
    return {"tools": [CALC], "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ex"},
        {"role": "assistant", "content": "worked", "weight": 0},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "result: 2"},
        {"role": "assistant", "content": reply},
    ]}


def _spans(sample) -> list[list[int]]:
    spans, current = [], []
    for token, m in zip(sample.input_ids, sample.loss_mask, strict=True):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def test_a_record_trains_the_sampled_ids_of_its_weighted_assistant_messages(tokenizer):
    renderer = ChatMLRenderer(tokenizer)
    sample = demo_sample(_record(), renderer)
    call_text = '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
    end = renderer.end_of_turn_id
    assert _spans(sample) == [[*renderer.encode(call_text), end], [*renderer.encode("2"), end]]
    from forgerl.gateway.protocols import chat

    raw = [{k: v for k, v in m.items() if k != "weight"} for m in _record()["messages"]]
    whole = renderer.render(chat.messages(raw), chat.tools([CALC]), add_generation_prompt=False)
    assert sample.input_ids == whole[:-1]  # the model's own chat format, to the last end id
    # the first trained id directly follows the generation prompt of its call
    prompt = renderer.render(chat.messages(raw[:4]), chat.tools([CALC]))
    assert sample.loss_mask[len(prompt) - 1 : len(prompt) + 1] == [0, 1]
    assert sample.advantages == [float(m) for m in sample.loss_mask]
    assert set(sample.temperatures) == {1.0} and set(sample.behavior_logprobs) == {0.0}


def test_bad_demonstration_files_name_the_line(tokenizer, tmp_path):
    renderer = ChatMLRenderer(tokenizer)
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(_record()) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"demos.jsonl line 3"):
        load_demos(path, renderer)
    untrained = _record()
    for m in untrained["messages"]:
        m["weight"] = 0
    path.write_text(json.dumps(untrained) + "\n")
    with pytest.raises(ValueError, match=r"line 1: no assistant message to train"):
        load_demos(path, renderer)
    path.write_text(json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: not chat messages"):
        load_demos(path, renderer)
    path.write_text("\n")
    with pytest.raises(ValueError, match="has no records"):
        load_demos(path, renderer)
    with pytest.raises(ValueError, match="cannot read"):
        load_demos(tmp_path / "missing.jsonl", renderer)


def test_supervised_step_is_the_token_mean_nll_with_naive_gradients(tokenizer):
    renderer = ChatMLRenderer(tokenizer)
    samples = [demo_sample(_record("2"), renderer), demo_sample(_record("22"), renderer)]
    model = build_tiny_model()
    naive = build_tiny_model()
    naive.load_state_dict(model.state_dict())
    total, n = 0.0, sum(sum(s.loss_mask) for s in samples)
    for s in samples:  # unpacked: one full forward per sample, no prefix sharing
        ids = torch.tensor([s.input_ids])
        logp = torch.log_softmax(naive(ids).logits[0, :-1].float(), -1)
        picked = logp.gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        loss = -picked[mask].sum() / n
        loss.backward()
        total += loss.item()
    trainer = Trainer(model, lr=1e-3, max_row_tokens=1024, device="cpu")
    batch = trainer.pack(samples, {})
    call = len('<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>') + 1
    assert batch.num_loss_tokens == n == 2 * call + 2 + 3  # byte tokens: the call twice, "2", "22"
    assert batch.tree.num_tree_tokens < batch.tree.num_input_tokens  # the shared prefix once
    stats = trainer.accumulate_gradients(batch, nll_loss)
    assert stats["loss"] == pytest.approx(total, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), naive.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    trainer.optimizer.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = trainer.supervised_step(samples)
    assert trainer.step == 1 and metrics["loss"] == pytest.approx(total, rel=1e-5)
    assert metrics["num_loss_tokens"] == n and metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_step_records_cover_each_epoch_once_and_repeat_per_step():
    picked = [step_records(6, step, 3, seed=1) for step in range(4)]
    assert sorted(picked[0] + picked[1]) == sorted(picked[2] + picked[3]) == list(range(6))
    assert picked[0] + picked[1] != picked[2] + picked[3]  # each epoch its own shuffle
    assert step_records(6, 2, 3, seed=1) == picked[2]
    assert step_records(4, 1, 3, seed=0)[:1] == [step_records(4, 0, 4, seed=0)[3]]


def test_config_refuses_warm_start_steps_without_demos_or_beyond_max_steps():
    from forgerl.config import ConfigError

    with pytest.raises(ConfigError, match=r"warmstart\.steps needs warmstart\.demos"):
        load_config(None, ["--warmstart.steps", "2"])
    with pytest.raises(ConfigError, match="max_steps >= it"):
        load_config(None, ["--warmstart.steps", "20", "--warmstart.demos", "x.jsonl"])


@pytest.mark.slow
def test_a_run_warm_starts_first_evaluates_and_resumes_after_it(tmp_path, tokenizer):
    from forgerl.controller import run
    from tests.test_controller import make_agent, tiny_config

    demos = tmp_path / "demos.jsonl"
    demos.write_text("\n".join(json.dumps(_record(str(k))) for k in range(5)) + "\n")
    run_dir = tmp_path / "run"
    args = ["--warmstart.demos", str(demos), "--warmstart.steps", "2",
            "--warmstart.batch_size", "3", "--warmstart.lr", "1e-2", "--tasks.eval_every", "5"]
    asyncio.run(run(tiny_config(run_dir, *args, "--max_steps", "3"), agent=make_agent(),
                    progress=False))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in records if r.get("phase") == "warmstart"]
    assert [r["step"] for r in warm] == [1, 2]
    assert all(r["demos"] == 5 and r["num_loss_tokens"] > 0 for r in warm)
    assert warm[1]["loss"] < warm[0]["loss"]  # lr 1e-2 on the same tiny records
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2, 3]
    assert [r["step"] for r in records if "reward_mean" in r] == [3]  # the RL step
    db = sqlite3.connect(run_dir / "pool.sqlite")
    versions = {v for (v,) in db.execute("SELECT DISTINCT weight_version FROM completions")}
    assert min(versions) == 0 and 2 in versions  # step-0 eval, then rollouts of the warm weights
    demos.unlink()  # past the warm start: the demonstrations are not read again
    asyncio.run(run(tiny_config(run_dir, *args, "--max_steps", "4"), agent=make_agent(),
                    progress=False))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("phase") == "warmstart"] == [1, 2]
    assert [r["step"] for r in records if "reward_mean" in r] == [3, 4]
    # warmstart.steps raised after RL began: refused, not run as steps 5-6 after RL step 4
    demos.write_text("\n".join(json.dumps(_record(str(k))) for k in range(5)) + "\n")
    raised = [*args[:3], "6", *args[4:], "--max_steps", "7"]
    with pytest.raises(ConfigError, match=r"warmstart.steps: 6 would run supervised steps after "
                                          r"RL step 4; warm start comes first \(at most 2 here"):
        asyncio.run(run(tiny_config(run_dir, *raised), agent=make_agent(), progress=False))


def test_a_record_longer_than_the_row_budget_is_refused_when_the_file_is_read(tokenizer,
                                                                              tmp_path):
    renderer = ChatMLRenderer(tokenizer)
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(_record()) + "\n" + json.dumps(_record("9" * 600)) + "\n")
    assert len(load_demos(path, renderer, max_tokens=2048)) == 2
    with pytest.raises(ValueError, match=r"line 2: 12\d\d tokens exceed trainer.max_row_tokens"):
        load_demos(path, renderer, max_tokens=1000)
