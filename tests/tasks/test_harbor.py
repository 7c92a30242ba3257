"""The Harbor adapter (forgerl/tasks/harbor.py) on Harbor task folders: the generated example set
(examples/harbor_tasks/generate.py) and tasks written here in Harbor's format, built and verified
in real sandboxes (forgerl/agents/sandbox.py), and one run end to end: the shell agent
(examples/harbor_tasks/shell_agent.py) in each rollout's sandbox, its commands from the scripted
policy through the real gateway, test.sh's rewards in the pool, a training step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.agents.sandbox import Sandbox
from forgerl.config import ConfigError
from forgerl.controller import make_task_sets, start_services
from forgerl.tasks.base import EnvironmentError
from forgerl.tasks.harbor import Adapter

from ..test_controller import sync, tiny_config
from .conftest import one_step, script_policy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "harbor_tasks"


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("harbor") / "tasks"
    subprocess.run([sys.executable, str(EXAMPLE / "generate.py"), str(out), "--count", "10"],
                   check=True, capture_output=True)
    return out


def write_task(root: Path, name: str, test: str, dockerfile: str = "FROM x\nWORKDIR /app\n",
               toml: str = "[verifier]\ntimeout_sec = 5.0\n") -> Path:
    """A Harbor task folder written here."""
    folder = root / name
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "instruction.md").write_text(f"Task {name}.\n")
    (folder / "task.toml").write_text(toml)
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    (folder / "tests" / "test.sh").write_text("#!/bin/bash\n" + test)
    return folder


async def open_sandbox(parent: Path, name: str, mounts: list[str], port: int) -> Sandbox:
    """A sandbox as a rollout's (forgerl/tasks/episode.py): each mount under its fs/."""
    here = {m: parent / name / "fs" / m.strip("/") for m in mounts}
    return await Sandbox.open(parent, name, gateway_port=port, mounts=here)


async def episode_of(adapter: Adapter, task: dict, parent: Path, name: str):
    sandbox = await open_sandbox(parent, name, adapter.mounts(task), 9)
    return sandbox, await adapter.open(task, sandbox)


@sync
async def test_every_generated_solution_passes_its_tests_and_an_empty_attempt_fails(
        generated, tmp_path):
    adapter = Adapter(str(generated), {}, tmp_path)
    tasks = [{"question": "", "harbor_task": str(p)} for p in sorted(generated.iterdir())]
    assert len(tasks) == 10
    alive = Sandbox.alive
    for i, task in enumerate(tasks):
        for solve in (True, False):
            sandbox, episode = await episode_of(adapter, task, tmp_path / "boxes", f"t{i}{solve}")
            try:
                if solve:
                    assert await episode.solve() == 0
                assert await episode.score(None, []) == (1.0 if solve else 0.0), task
                assert episode.verifier_status == "ok"
            finally:
                await episode.close()
                await sandbox.close()
    assert Sandbox.alive == alive and not any((tmp_path / "boxes").iterdir())


def test_tasks_prompt_and_mounts_follow_the_task_folders(generated, tmp_path):
    adapter = Adapter(str(generated), {}, tmp_path)
    train, held = adapter.tasks("train", 20, 1), adapter.tasks("eval", 2, 2)
    names = {Path(t["harbor_task"]).name for t in train}
    assert len(train) == 20 and len(names) == 8  # 10 tasks, 20% held out, cycled
    assert {Path(t["harbor_task"]).name for t in held}.isdisjoint(names) and len(held) == 2
    folder = Path(train[0]["harbor_task"])
    assert train[0]["question"] == (folder / "instruction.md").read_text()
    assert adapter.tasks("train", 20, 1) == train and adapter.tasks("train", 20, 3) != train
    assert adapter.mounts(train[0]) == ["/app", "/logs", "/solution", "/tests"]
    lone = Adapter(str(folder), {}, tmp_path)  # one task: all training, none held out
    assert [t["harbor_task"] for t in lone.tasks("train", 3, 0)] == [str(folder)] * 3
    assert lone.tasks("eval", 3, 0) == []
    with pytest.raises(ValueError, match=r"unknown Harbor params \['bogus'\]"):
        Adapter(str(generated), {"bogus": 1}, tmp_path).tasks("train", 1, 0)


@sync
async def test_dockerfile_build_env_and_the_reward_files(tmp_path, monkeypatch):
    docker = ('FROM ubuntu:24.04\nARG X=1\nWORKDIR /srv\nENV GREETING="hi there" N=3\n'
              'COPY data.txt ./\nRUN echo "$GREETING" > built.txt && \\\n    echo $N >> built.txt\n'
              'CMD ["bash"]\n')
    json_task = write_task(tmp_path, "json", 'cat /srv/built.txt > /logs/verifier/seen\n'
                           'echo \'{"reward": 0.5, "style": 1}\' > /logs/verifier/reward.json\n'
                           'echo 1 > /logs/verifier/reward.txt\n', docker,
                           '[verifier]\ntimeout_sec = 5.0\nenv = {MODE = "${NOPE:-strict}"}\n'
                           '[environment]\nenv = {TOKEN = "${HARBOR_T}"}\n')
    (json_task / "environment" / "data.txt").write_text("payload\n")
    cases = {
        "json": (0.5, "ok"),
        "txt": (write_task(tmp_path, "txt", "echo 0.25 > /logs/verifier/reward.txt\n"), 0.25, "ok"),
        "slow": (write_task(tmp_path, "slow", "sleep 30\n", toml="[verifier]\ntimeout_sec = 1\n"),
                 0.0, "timeout"),
        "none": (write_task(tmp_path, "none", "exit 3\n"), 0.0, "error"),
        "nan": (write_task(tmp_path, "nan", "echo nan > /logs/verifier/reward.txt\n"), 0.0,
                "error"),
        "many": (write_task(tmp_path, "many", "echo '{\"a\": 1, \"b\": 0}' > "
                            "/logs/verifier/reward.json\n"), 0.0, "error"),
    }
    cases["json"] = (json_task, *cases["json"])
    adapter = Adapter(str(tmp_path), {}, tmp_path)
    monkeypatch.setenv("HARBOR_T", "tok")
    for name, (folder, reward, status) in cases.items():
        task = {"question": "", "harbor_task": str(folder)}
        sandbox, episode = await episode_of(adapter, task, tmp_path / "boxes", name)
        try:
            assert await episode.score(None, []) == reward, name
            assert episode.verifier_status == status, name
            if name == "json":
                assert episode.workdir == Path("/srv") and episode.env == {
                    "GREETING": "hi there", "N": "3", "TOKEN": "tok"}
                logs = sandbox.mounts["/logs"] / "verifier"
                assert (logs / "seen").read_text() == "hi there\n3\n"
                assert (sandbox.mounts["/srv"] / "data.txt").read_text() == "payload\n"
        finally:
            await sandbox.close()


@sync
async def test_a_failed_build_or_a_dead_sandbox_is_an_infrastructure_failure(tmp_path):
    bad = write_task(tmp_path, "bad", "true\n", "FROM x\nWORKDIR /app\nRUN exit 7\n")
    ok = write_task(tmp_path, "ok", "echo 1 > /logs/verifier/reward.txt\n")
    adapter = Adapter(str(tmp_path), {}, tmp_path)
    sandbox = await open_sandbox(tmp_path / "boxes", "bad", ["/app", "/logs", "/tests"], 9)
    with pytest.raises(EnvironmentError, match="RUN 'exit 7' exit 7"):
        await adapter.open({"question": "", "harbor_task": str(bad)}, sandbox)
    await sandbox.close()
    sandbox, episode = await episode_of(adapter, {"question": "", "harbor_task": str(ok)},
                                        tmp_path / "boxes", "ok")
    await sandbox.close()  # the sandbox is gone before the verifier runs
    with pytest.raises(EnvironmentError, match="sandbox"):
        await episode.score(None, [])
    with pytest.raises(EnvironmentError, match="need a sandbox"):
        await adapter.open({"question": "", "harbor_task": str(ok)}, None)


def test_bad_task_folders_are_one_line_config_errors(tmp_path):
    write_task(tmp_path / "set", "from", "true\n", "FROM a\nCOPY --from=b /x /app/\n")
    write_task(tmp_path / "outside", "etc", "true\n", "FROM a\nCOPY f /etc/f\n")
    write_task(tmp_path / "toml", "broken", "true\n", toml="[verifier\n")
    write_task(tmp_path / "good", "ok", "true\n")
    for env, params, message in [
            (tmp_path / "nothing", "{}", "env: .*no such folder of Harbor tasks"),
            (tmp_path, "{}", "env: .*no Harbor task"),
            (tmp_path / "set", "{}", "env: .*only the build context is copied"),
            (tmp_path / "outside", "{}", "env: .*COPY to /etc/f: only /app"),
            (tmp_path / "toml", "{}", "env: .*/broken/task.toml: not valid TOML"),
            (tmp_path / "good", "{eval_fraction = 7}", r"params.eval_fraction: a number in "
                                                       r"\[0, 1\), got 7"),
            (tmp_path / "good", '{eval_fraction = "x"}', "params.eval_fraction: a number"),
            (tmp_path / "good", "{evals = 'x'}", r"params: unknown keys \['evals'\] for source "
                                                 r"'harbor' \(it reads eval, eval_fraction\)")]:
        config = tiny_config(tmp_path / "run", "--tasks.source", "harbor", "--tasks.env",
                             str(env), "--tasks.params", params, "--tasks.eval_size", "0")
        with pytest.raises(ConfigError, match=f"^tasks.{message}") as e:
            make_task_sets(config)
        assert "\n" not in str(e.value)


def _solutions(root: Path) -> dict[str, str]:
    """instruction → the solution's command (solve.sh's last line)."""
    return {(p / "instruction.md").read_text().strip():
            (p / "solution" / "solve.sh").read_text().strip().splitlines()[-1]
            for p in root.iterdir()}


@sync
async def test_a_run_trains_on_harbor_tasks_through_a_shell_agent_in_sandboxes(
        generated, tmp_path):
    solutions, tries = _solutions(generated), {}

    def policy(prompt: str) -> str:
        """Done after a command's output; else the solution on even tries, a no-op on odd."""
        if "exit 0" in prompt or "exit 1" in prompt:
            return "DONE"
        [question] = [q for q in solutions if q in prompt]
        tries[question] = tries.get(question, -1) + 1
        return f"```sh\n{solutions[question]}\n```" if tries[question] % 2 == 0 else "true"

    config = tiny_config(tmp_path / "run", "--tasks.source", "harbor", "--tasks.env",
                         str(generated), "--tasks.params", "{}", "--tasks.size", "8",
                         "--tasks.eval_size", "0", "--rollout.max_tokens", "48",
                         "--model.max_model_len", "1024", "--agent.command",
                         json.dumps(["python", "shell_agent.py"]), "--agent.cwd", str(EXAMPLE),
                         "--agent.max_turns", "2", "--agent.preload", "[]")
    async with start_services(config) as s:
        answers = script_policy(s, policy)
        trajs, metrics = await one_step(s)
        status = dict(s.reward_status)
    assert len(trajs) == 8 and {t.status for t in trajs} == {"finished"}, [t.error for t in trajs]
    assert sorted(t.reward for t in trajs) == [0.0] * 4 + [1.0] * 4  # solution ↔ no-op
    assert all(len(t.completions) == 2 for t in trajs)  # a command, then DONE on its output
    assert "DONE" in answers and status["verifier_ok"] >= 8
    assert set(status) == {"verifier_ok"}
    assert metrics["num_loss_tokens"] > 0 and s.trainer.step == 1
    assert not any((Path(config.run_dir) / "sandboxes").iterdir()) and Sandbox.take_peak() >= 1


@sync
async def test_an_environment_that_does_not_build_aborts_its_rollouts_as_infrastructure(
        tmp_path):
    write_task(tmp_path / "set", "a", "true\n", "FROM x\nWORKDIR /app\nRUN apt-get nothing\n")
    write_task(tmp_path / "set", "b", "true\n", "FROM x\nWORKDIR /app\nRUN exit 1\n")
    config = tiny_config(tmp_path / "run", "--tasks.source", "harbor", "--tasks.env",
                         str(tmp_path / "set"), "--tasks.params", "{}", "--tasks.size", "4",
                         "--tasks.eval_size", "0", "--agent.command",
                         json.dumps(["python", "shell_agent.py"]), "--agent.cwd", str(EXAMPLE))
    async with start_services(config) as s:
        script_policy(s, lambda prompt: "true")
        trajs, metrics = await one_step(s)
    assert {t.status for t in trajs} == {"aborted_infra"}
    assert all("environment build: RUN" in t.error for t in trajs)
    assert metrics["rollouts_aborted_infra"] == 8 and metrics["num_loss_tokens"] == 0
