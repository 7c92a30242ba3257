"""The coding_cli example: its task file, its check scripts and its agent (unmodified Pi).

Semantics pinned: the task file makes deterministic tasks of four kinds whose starting files
and check are functions of the question alone; a hand-written correct solution of each kind
passes the check script (run by the agent's own `check`, in the working directory) and wrong
ones fail it (wrong word, other file touched, file emptied instead of deleted, line appended
to the last one). `score` gives 1.0 only for "pass". With a scripted engine behind the real
gateway, the agent runs Pi through one task: Pi calls `write`, the file is there, the check
passes, the agent prints "pass", and turn 2 of the trajectory extends turn 1 id for id.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.conftest import ScriptedEngine, reply, serve  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "coding_cli"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"coding_cli_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent = load("agent")
tasks = agent.tasks

CREATE = "Create a file named fruit.txt containing the word banana."
REPLACE = "In notes.txt, replace the word red with blue."
APPEND = "Append a line with the word seven to list.txt."
DELETE = "Delete the file old.txt."


def checked(question: str, tmp_path: Path, edit) -> tuple[bool, str]:
    """The agent's check of `question` after `edit(work)` changed its starting files."""
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    for name, text in tasks.workspace(question).items():
        (work / name).write_text(text)
    edit(work)
    return agent.check(question, work, tmp_path)


def test_task_file_is_deterministic_and_parses_its_questions():
    made = tasks.make_tasks(8, seed=3)
    assert made == tasks.make_tasks(8, seed=3) != tasks.make_tasks(8, seed=4)
    assert [t["metadata"]["kind"] for t in made] == list(tasks.KINDS) * 2
    assert [tasks.parse(t["question"])[0] for t in made] == list(tasks.KINDS) * 2
    assert tasks.parse(REPLACE) == ("replace", {"name": "notes.txt", "old": "red", "new": "blue"})
    assert tasks.workspace(CREATE) == {}
    start = tasks.workspace(REPLACE)
    assert start == tasks.workspace(REPLACE) and start["notes.txt"].split().count("red") == 1
    assert set(start) == {"notes.txt", "readme.txt"}
    with pytest.raises(ValueError, match="not a coding_cli task"):
        tasks.parse("Write a poem.")
    with pytest.raises(ValueError, match="unknown kinds"):
        tasks.make_tasks(2, 0, kinds=["rename"])
    assert [tasks.score({}, a) for a in ("pass", " PASS\n", "fail", "", "passed")] == [
        1.0, 1.0, 0.0, 0.0, 0.0]


def test_correct_solutions_pass_the_check(tmp_path):
    def create(w):
        (w / "fruit.txt").write_text("banana")  # no final newline: words per line count

    def replace(w):
        (w / "notes.txt").write_text((w / "notes.txt").read_text().replace("red", "blue"))

    def append(w):
        with open(w / "list.txt", "a") as f:
            f.write("seven\n")

    for question, edit in [(CREATE, create), (REPLACE, replace), (APPEND, append),
                           (DELETE, lambda w: (w / "old.txt").unlink())]:
        assert checked(question, tmp_path, edit) == (True, ""), question


def test_wrong_solutions_fail_the_check(tmp_path):
    def text(w, name):
        return (w / name).read_text()

    cases = [
        (CREATE, lambda w: None, "fruit.txt is missing"),
        (CREATE, lambda w: (w / "fruit.txt").write_text("bananas\n"), "fruit.txt holds"),
        (REPLACE, lambda w: (w / "notes.txt").write_text(text(w, "notes.txt") + "blue\n"),
         "notes.txt holds"),
        (REPLACE, lambda w: [(w / n).write_text(text(w, n).replace("red", "blue") + "x\n")
                             for n in ("notes.txt", "readme.txt")], "readme.txt holds"),
        (APPEND, lambda w: (w / "list.txt").write_text(text(w, "list.txt").strip() + "seven\n"),
         "list.txt holds"),
        (APPEND, lambda w: (w / "list.txt").write_text("seven\n" + text(w, "list.txt")),
         "list.txt holds"),
        (DELETE, lambda w: (w / "old.txt").write_text(""), "old.txt still exists"),
        (DELETE, lambda w: [(w / n).unlink() for n in ("old.txt", "readme.txt")],
         "readme.txt is missing"),
    ]
    for question, edit, reason in cases:
        passed, why = checked(question, tmp_path, edit)
        assert not passed and why.startswith(reason), (question, why)


PI = Path(agent.pi_executable())


@pytest.mark.skipif(not PI.exists() or shutil.which("node") is None,
                    reason="Pi is not installed (scripts/setup.sh installs harnesses/)")
def test_pi_runs_one_task_through_the_gateway(serve, tokenizer, tmp_path):  # noqa: F811
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    renderer = ChatMLRenderer(tokenizer)
    call = {"name": "write", "arguments": {"path": "fruit.txt", "content": "banana\n"}}
    script = [reply(renderer, f"<tool_call>\n{json.dumps(call)}\n</tool_call>"),
              reply(renderer, "Done.")]
    srv = serve(ScriptedEngine(list(script), max_model_len=32768), tokenizer)
    tid, key = srv.session()
    env = {"OPENAI_BASE_URL": srv.base_url, "OPENAI_API_KEY": key, "OPENAI_MODEL": "tiny",
           "FORGERL_MAX_TOKENS": "512", "FORGERL_PI_TIMEOUT_S": "60"}
    done = subprocess.run([sys.executable, str(EXAMPLE / "agent.py")], capture_output=True,
                          text=True, timeout=90, input=json.dumps({"question": CREATE}),
                          env={**os.environ, **env})
    assert done.stdout.splitlines()[-1] == "pass", done.stderr
    assert "turns 2 tool_calls 1 pi exit 0 check pass" in done.stderr
    first, second = srv.pool.get_trajectory(tid).completions
    assert [first.completion_ids, second.completion_ids] == [s.ids for s in script]
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)
    assert second.extends_previous and srv.gateway.counters["prefix_misses"] == 0
    prompt = renderer.decode(first.prompt_ids)  # special tokens left out
    assert "operating inside pi" in prompt and prompt.endswith(f"\nuser\n{CREATE}\nassistant\n")
    if agent.private_mount(tmp_path) is not None:  # every rollout's Pi sees the same directory
        assert f"Current working directory: {agent.FIXED_WORK}\n" in prompt
    assert "Successfully wrote 7 bytes to fruit.txt" in renderer.decode(second.prompt_ids)


@pytest.mark.skipif(not PI.exists() or shutil.which("node") is None,
                    reason="Pi is not installed (scripts/setup.sh installs harnesses/)")
def test_scripted_demonstrations_are_warm_start_records(tokenizer):
    from forgerl.controller.warmstart import demo_sample
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    sys.path.insert(0, str(EXAMPLE))  # demos.py imports agent and tasks by name
    try:
        demos = load("demos")
    finally:
        sys.path.remove(str(EXAMPLE))
    [rec] = demos.make_demos([REPLACE], workers=1)
    roles = [m["role"] for m in rec["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert [t["function"]["name"] for t in rec["tools"]] == ["read", "bash", "edit", "write"]
    call = rec["messages"][2]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == (
        "edit", {"path": "notes.txt", "edits": [{"oldText": "red", "newText": "blue"}]})
    renderer = ChatMLRenderer(tokenizer)
    sample = demo_sample(rec, renderer)
    trained = renderer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask,
                                                 strict=True) if m])
    assert trained == ('<tool_call>\n{"name": "edit", "arguments": {"path": "notes.txt", '
                       '"edits": [{"oldText": "red", "newText": "blue"}]}}\n</tool_call>Done.')
