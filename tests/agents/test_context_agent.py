"""The context_agent example's three modes through the real gateway (scripted engine, the
official AsyncOpenAI client inside the agent).

Semantics pinned: "learned" offers the CM tools and its compact call replaces the first long
report by the model's summary (the next prompt is a new branch, counted as a prefix miss);
"truncate" offers no CM tools and keeps only the newest KEEP_MESSAGES body messages, so the
first result is gone when the model answers; "forget" (a round mode) drops the old reports
on the model's forget call and keeps its replies; "none" keeps everything, and the call that no
longer fits in max_model_len is refused (a context_overflow event on the trajectory) and the
episode ends with an empty answer, the rollout still finishing normally.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from forgerl.agents.context import CM_NAMES, DROPPED
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from tests.gateway.conftest import ScriptedEngine, reply, serve  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "context_agent" / "agent.py"
spec = importlib.util.spec_from_file_location("context_agent", EXAMPLE)
agent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent)
TASK = {"question": "Compute 1234 + 5678 and 4321 - 876.", "answer": "6912, 3445"}


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def _run(serve, tokenizer, mode: str, script: list[str], max_model_len: int = 1 << 16):  # noqa: F811
    r = ChatMLRenderer(tokenizer)
    engine = ScriptedEngine([reply(r, text) for text in script], max_model_len=max_model_len)
    srv = serve(engine, tokenizer, model_name="policy")
    tid, key = srv.session()
    answer = asyncio.run(agent.make_agent(mode, max_tokens=256)(TASK, srv.base_url, key))
    prompts = [r.decode(ids) for ids, _ in engine.calls]
    return answer, prompts, srv, tid


def test_report_is_long_and_ends_with_the_result():
    text = agent.report("1234 + 5678")
    lines = text.splitlines()
    assert lines[-1] == "result: 6912" and len(lines) == agent.REPORT_LINES + 2
    assert agent.report("12 * 3").startswith("error")
    with pytest.raises(ValueError, match="mode must be"):
        agent.make_agent("forgetful")


def test_learned_mode_compacts_and_answers_from_the_summary(serve, tokenizer):  # noqa: F811
    script = [_call("calculator", {"expression": "1234 + 5678"}),
              _call("compact", {"summary": "1234 + 5678 = 6912"}),
              _call("calculator", {"expression": "4321 - 876"}), "6912, 3445"]
    answer, prompts, srv, _ = _run(serve, tokenizer, "learned", script)
    assert answer == "6912, 3445"
    assert "\"compact\"" in prompts[0] and "forget_tool_outputs" not in prompts[0]
    assert "result: 6912" in prompts[1] and "trace 19" in prompts[1]
    # after compact: the first report is gone, the summary is there
    last_turn = prompts[3].split(TASK["question"])[-1]
    assert "result: 6912" not in last_turn and "Your summary: 1234 + 5678 = 6912" in last_turn
    assert "result: 3445" in last_turn
    assert srv.gateway.counters["prefix_misses"] == 1  # the compacted prompt is a new branch


def test_truncate_mode_drops_the_first_report(serve, tokenizer):  # noqa: F811
    script = [_call("calculator", {"expression": "1234 + 5678"}),
              _call("calculator", {"expression": "4321 - 876"}), "6912, 3445"]
    answer, prompts, _, _ = _run(serve, tokenizer, "truncate", script)
    assert answer == "6912, 3445"
    assert not any(name in prompts[0] for name in CM_NAMES)
    last_turn = prompts[2].split(TASK["question"])[-1]
    assert "result: 6912" not in last_turn and "result: 3445" in last_turn


def test_none_mode_overflows_and_ends_without_an_answer(serve, tokenizer):  # noqa: F811
    script = [_call("calculator", {"expression": "1234 + 5678"}),
              _call("calculator", {"expression": "4321 - 876"}), "6912, 3445"]
    _, prompts, _, _ = _run(serve, tokenizer, "none", script)
    third = len(tokenizer(prompts[2]).input_ids)  # the answer turn's prompt length
    answer, prompts, srv, tid = _run(serve, tokenizer, "none", script, max_model_len=third - 1)
    assert answer == "" and len(prompts) == 2
    assert srv.gateway.counters["context_overflows"] == 1
    assert [e.kind for e in srv.pool.get_trajectory(tid).events] == ["context_overflow"]


def _after_head(prompt: str) -> str:
    """A round-mode prompt after its worked examples (the last ends with this answer)."""
    return prompt.split("assistant\n-827, 5356\n")[-1]


def test_summarize_mode_replaces_old_rounds_by_the_model_summary(serve, tokenizer):  # noqa: F811
    """Round modes: "Compute A.", "Compute B.", FINAL; past COMPACT_AT tokens (always here: the
    byte tokenizer makes the head alone longer) the harness asks for a summary after rounds 1
    and 2, and the next round's prompt holds the summary, not the old rounds: a new branch."""
    script = [_call("calculator", {"expression": "1234 + 5678"}), "6912", "6912",
              _call("calculator", {"expression": "4321 - 876"}), "3445", "6912, 3445",
              "6912, 3445"]
    answer, prompts, srv, _ = _run(serve, tokenizer, "summarize", script)
    prompts = [_after_head(p) for p in prompts]
    assert answer == "6912, 3445" and len(prompts) == 7
    assert "user\nCompute 1234 + 5678." in prompts[0] and "Compute 4321" not in prompts[0]
    assert "result: 6912" in prompts[2] and prompts[2].endswith(
        f"user\n{agent.SUMMARIZE}\nassistant\n")
    assert "result: 6912" not in prompts[3]
    assert f"user\n{agent.SUMMARY}6912\nCompute 4321 - 876." in prompts[3]
    assert "result: 3445" not in prompts[6] and "Compute 4321" not in prompts[6]
    assert f"user\n{agent.SUMMARY}6912, 3445\n{agent.FINAL}" in prompts[6]
    assert srv.gateway.counters["prefix_misses"] == 2  # two compactions, two new branches


def test_drop_mode_loses_the_first_result(serve, tokenizer):  # noqa: F811
    script = [_call("calculator", {"expression": "1234 + 5678"}), "6912",
              _call("calculator", {"expression": "4321 - 876"}), "3445", "3445"]
    answer, prompts, _, _ = _run(serve, tokenizer, "drop", script)
    prompts = [_after_head(p) for p in prompts]
    assert answer == "3445" and len(prompts) == 5
    assert "6912" not in prompts[2] and "Summary" not in prompts[2]
    assert prompts[4].split("user\n")[-1].startswith(agent.FINAL)
    assert "6912" not in prompts[4] and "3445" not in prompts[4].split(agent.FINAL)[-1]
    with pytest.raises(ValueError, match="Compute A and B"):
        agent.rounds("What is 2 + 2?")


def test_forget_mode_drops_old_reports_on_the_models_call_and_keeps_its_replies(
        serve, tokenizer):  # noqa: F811
    """Round mode "forget": the model's forget call at the start of round 2 replaces round 1's
    long report by DROPPED (its reply "6912" stays), so the next prompt branches off the
    recorded turns after round 1's calculator call (a new training sample); the
    same session without the call overflows once the second report is in the prompt."""
    a, b = (_call("calculator", {"expression": e}) for e in ("1234 + 5678", "4321 - 876"))
    script = [a, "6912", _call("forget_tool_outputs", {}), b, "3445", "6912, 3445"]
    answer, prompts, srv, tid = _run(serve, tokenizer, "forget", script)
    prompts = [_after_head(p) for p in prompts]
    assert answer == "6912, 3445" and len(prompts) == 6
    assert "trace 19" in prompts[1] and "trace 19" in prompts[2]  # read, then forgotten:
    assert "trace 19" not in prompts[3] and f"<tool_response>\n{DROPPED}\n" in prompts[3]
    assert "assistant\n6912" in prompts[5] and "result: 3445" in prompts[5]
    c = srv.pool.get_trajectory(tid).completions
    call_a = c[0].prompt_ids + c[0].completion_ids
    assert c[3].prompt_ids[: len(call_a)] == call_a  # a branch from the turn before the report
    assert c[3].prompt_ids[: len(c[2].prompt_ids)] != c[2].prompt_ids  # not the forget turn's
    assert c[2].prompt_ids[: len(c[1].prompt_ids)] == c[1].prompt_ids  # (before: one branch)
    script = [a, "6912", b, "3445", "6912, 3445"]  # no forget call
    _, prompts, _, _ = _run(serve, tokenizer, "forget", script)
    fourth = len(tokenizer(prompts[3]).input_ids)  # both reports in the prompt
    answer, prompts, srv, tid = _run(serve, tokenizer, "forget", script, max_model_len=fourth - 1)
    assert answer == "" and len(prompts) == 3
    assert [e.kind for e in srv.pool.get_trajectory(tid).events] == ["context_overflow"]


def test_forget_demonstrations_are_the_samples_of_the_same_session_through_the_gateway(
        serve, tokenizer, monkeypatch):  # noqa: F811
    """demos.py's teacher drives the real agent; its records, rendered for the warm start,
    hold exactly the token ids and loss mask of the same session recorded by the gateway
    (the scripted engine replaying the teacher's replies): two branches, the forget call
    trained at the end of the first, round 1's replies context in the second."""
    from forgerl.controller.warmstart import demo_sample
    from forgerl.trainer.samples import trajectory_to_samples

    monkeypatch.setitem(sys.modules, "agent", agent)  # demos.py's own `from agent import`
    path = EXAMPLE.with_name("demos.py")
    spec = importlib.util.spec_from_file_location("context_demos", path)
    demos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demos)
    records = asyncio.run(demos.session_records(TASK))
    assert len(records) == 2
    trained = [[(m["content"], [c["function"]["name"] for c in m.get("tool_calls", [])])
                for m in r["messages"] if m["role"] == "assistant" and m["weight"]]
               for r in records]
    assert trained == [[("", ["calculator"]), ("6912", []), ("", ["forget_tool_outputs"])],
                       [("", ["calculator"]), ("3445", []), ("6912, 3445", [])]]
    a, b = (_call("calculator", {"expression": e}) for e in ("1234 + 5678", "4321 - 876"))
    script = [a, "6912", _call("forget_tool_outputs", {}), b, "3445", "6912, 3445"]
    _, _, srv, tid = _run(serve, tokenizer, "forget", script)
    traj = srv.pool.get_trajectory(tid)
    recorded = trajectory_to_samples(traj, [1.0] * len(traj.completions))
    renderer = ChatMLRenderer(tokenizer)
    shown = [demo_sample(r, renderer) for r in records]
    assert [s.input_ids for s in shown] == [s.input_ids for s in recorded]
    assert [s.loss_mask for s in shown] == [s.loss_mask for s in recorded]
