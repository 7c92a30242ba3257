"""Crash consistency of `forgerl train` as a user runs it (real processes, tiny model).

A short run (4 steps, a checkpoint every 2, held-out evaluation every 2) is stopped at seeded
random moments with SIGKILL, SIGINT or SIGTERM and re-run with the same command each time until
it finishes. Then the run's three records must agree as if it had never been stopped:
exactly `max_steps` optimizer steps in the checkpoint; one metrics record per step (and one
step-0 evaluation); the pool's trained marks are exactly the groups those records name (each
task trained at most once, `max_steps * k` groups trained with signal); no agent process (nor
its child) survives any stop. The single-signal cases of issue 8 have their own tests below.
The random stops and the SIGKILL after a checkpoint also run with the pool in PostgreSQL
(`[datapool] url`, a real server from tests/pg.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forgerl.datapool import open_pool

pytestmark = pytest.mark.slow
FORGERL = [sys.executable, "-m", "forgerl"]

# One model call; right or wrong by the sampled reply (seeded by the run's `seed`), so group
# rewards vary. Records its pid and a sleeping child's pid, which must die with the run.
AGENT = """\
import json, os, pathlib, subprocess, sys
from openai import OpenAI
pids = pathlib.Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
(pids / str(os.getpid())).write_text(str(child.pid))
q = json.loads(os.environ["FORGERL_TASK"])["question"]
reply = OpenAI().chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                         max_tokens=int(os.environ["FORGERL_MAX_TOKENS"]),
                                         messages=[{"role": "user", "content": q}])
text = reply.choices[0].message.content or ""
print(eval(q.rsplit(":", 1)[1].replace("=", "")) if len(text) % 2 else "no idea")
"""


@pytest.fixture(params=["sqlite", "postgres"])
def pool_url(request: pytest.FixtureRequest) -> str:
    """[datapool] url: "" (SQLite in the run folder) or a fresh PostgreSQL database."""
    return "" if request.param == "sqlite" else request.getfixturevalue("pg_url")


def write_config(tmp_path: Path, max_steps: int = 4, checkpoint_every: int = 2,
                 pool_url: str = "") -> Path:
    pids = tmp_path / "pids"
    pids.mkdir(exist_ok=True)
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    config = tmp_path / "c.toml"
    config.write_text(
        f"run_dir = {str(tmp_path / 'run')!r}\nmax_steps = {max_steps}\nseed = 7\n"
        "[model]\npath = 'tiny'\nmax_model_len = 512\n"
        f"[agent]\ncommand = ['python', {str(agent)!r}, {str(pids)!r}]\n"
        "[tasks]\neval_size = 2\neval_every = 2\n"
        "params = {min_terms = 2, max_terms = 2, max_digits = 1}\n"
        "[rollout]\ngroup_size = 4\ntasks_per_step = 1\nmax_tokens = 4\n"
        f"[trainer]\ncheckpoint_every = {checkpoint_every}\nlr = 1e-3\n"
        f"[datapool]\nurl = {pool_url!r}\n")
    return config


def gone(pid: int, wait_s: float = 10.0) -> bool:
    """True once `pid` no longer runs (a zombie waiting for init to reap it counts as gone)."""
    deadline = time.time() + wait_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.time() >= deadline:
            return False
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def mark_processes(tmp_path, monkeypatch):
    """Every process a test starts (runs, agents, their children, reapers) inherits this mark:
    /proc/PID/environ finds them all, even one killed before it wrote its pid file."""
    monkeypatch.setenv("FORGERL_TEST_MARK", str(tmp_path))


def survivors(tmp_path: Path, wait_s: float = 10.0) -> list[int]:
    """Processes this test started that are still alive (not zombies) after `wait_s` seconds."""
    needle = f"FORGERL_TEST_MARK={tmp_path}".encode()
    deadline = time.time() + wait_s
    while True:
        alive = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0") and not gone(
                        int(entry.name), wait_s=0):
                    alive.append(int(entry.name))
            except OSError:
                continue
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


def check_run_state(run_dir: Path, max_steps: int, k: int = 1, pool_url: str = "") -> None:
    """Checkpoint, metrics and pool agree, as after an uninterrupted run."""
    ckpt = max(run_dir.glob("checkpoints/step_*/trainer_state.json"))
    state = json.loads(ckpt.read_text())
    assert state["step"] == max_steps
    logged = records(run_dir)
    assert [r["step"] for r in logged] == list(range(max_steps + 1))
    assert "eval_accuracy" in logged[0] and "reward_mean" not in logged[0]
    db = open_pool(pool_url or run_dir / "pool.sqlite")
    pool = dict(db._read("SELECT task_index, trained_step FROM tasks WHERE status='trained'"))
    db.close()
    named = {}
    for r in logged[1:]:
        assert len(r["trained_tasks"]) == k
        named |= {i: r["step"] for i in r["trained_tasks"]}
        named |= {i: r["step"] - 1 for i in r["tasks_without_signal"]}
    assert pool == named  # each task once, at the step that logged it; nothing unlogged
    queue = state["extra"]["scheduler"]["queue"]
    assert queue["head"] == min(set(range(max(pool) + 2)) - set(pool))


def test_random_stops_resume_to_the_same_run(tmp_path, pool_url):
    config = write_config(tmp_path, pool_url=pool_url)
    run_dir = tmp_path / "run"
    rng = random.Random(8)
    stops = []
    for _ in range(6):
        sig = rng.choice([signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
        delay = rng.uniform(1.0, 12.0)
        proc = subprocess.Popen([*FORGERL, "train", str(config)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            proc.wait(delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
        stops.append((sig.name, round(delay, 1), proc.returncode))
        assert "Traceback" not in err, (stops, err)
        if proc.returncode == 128 + sig:  # a clean stop says so in one line
            assert err.strip().splitlines()[-1].startswith(f"forgerl: stopped by {sig.name}")
        else:  # killed, stopped before the CLI's handlers were in place, or already done
            assert proc.returncode in (-sig, 0), (stops, err)
        assert survivors(tmp_path) == [], stops
    final = subprocess.run([*FORGERL, "train", str(config)], capture_output=True, text=True,
                           timeout=300)
    assert final.returncode == 0, (stops, final.stderr)
    assert survivors(tmp_path) == []
    check_run_state(run_dir, max_steps=4, pool_url=pool_url)
    assert (run_dir / "pool.sqlite").exists() == (not pool_url)
    again = subprocess.run([*FORGERL, "train", str(config)], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and "is finished: step 4 of max_steps 4" in again.stdout
    assert len(records(run_dir)) == 5  # no new evaluation, no new record


def test_ctrl_c_before_the_first_checkpoint_resumes(tmp_path):
    """Issue 8: stopped at step 1 with checkpoint_every = 4, every re-run used to fail with
    'task 0 was already trained'. Now the re-run restarts from the initial weights, retrains
    the consumed groups once, logs each step once, and `--max_steps` continues a done run."""
    config = write_config(tmp_path, max_steps=2, checkpoint_every=4)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*FORGERL, "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(r["step"] == 1 for r in records(run_dir)):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "step 1/2" in out  # one plain progress line per step when stdout is not a terminal
    assert not list(run_dir.glob("checkpoints/step_*"))
    result = subprocess.run([*FORGERL, "train", str(config)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "forgerl: done: 2 steps;" in result.stdout and "held-out accuracy" in result.stdout
    check_run_state(run_dir, max_steps=2)
    more = subprocess.run([*FORGERL, "train", str(config), "--max_steps", "3"],
                          capture_output=True, text=True, timeout=300)
    assert more.returncode == 0, more.stderr
    assert f"resuming {run_dir} with changed settings: max_steps: 2 -> 3\n" in more.stderr
    assert "changed settings" not in result.stderr  # the same config resumed: nothing to say
    check_run_state(run_dir, max_steps=3)
    assert len(list(run_dir.glob("checkpoints/step_*"))) == 1  # keep_checkpoints = 1
    assert survivors(tmp_path) == []
    assert list((run_dir / "agent_logs").glob("task000000_r*.log"))


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGHUP", "SIGINT under nohup",
                                 "SIGKILL"])
def test_every_stop_leaves_no_agent_process(tmp_path, how):
    """Agents that hang (and have a child) while the run is stopped: Ctrl-C, SIGTERM and SIGHUP
    stop it the same way (also with SIGINT ignored, as under nohup); SIGKILL of the run leaves
    the agents to its reaper. No agent process or child survives; the pool is kept."""
    hang = tmp_path / "hang.py"
    hang.write_text(AGENT.replace("q = json", "import time; time.sleep(600)\nq = json"))
    config = write_config(tmp_path, max_steps=1)
    text = config.read_text().replace(str(tmp_path / "agent.py"), str(hang))
    config.write_text(text.replace("eval_size = 2", "eval_size = 0"))
    sig = signal.Signals[how.split()[0]]
    ignore = signal.SIG_IGN if "nohup" in how else signal.SIG_DFL
    proc = subprocess.Popen([*FORGERL, "train", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, ignore))
    deadline = time.time() + 90
    while len(list((tmp_path / "pids").iterdir())) < 4 and time.time() < deadline:
        time.sleep(0.1)
    assert len(list((tmp_path / "pids").iterdir())) >= 4, "agents did not start"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGKILL:
        assert proc.returncode == -9
    else:
        assert proc.returncode == 128 + sig, err
        assert err.strip().splitlines() == [
            f"forgerl: stopped by {sig.name}; re-run the same command to resume"]
    assert survivors(tmp_path) == []
    assert (tmp_path / "run" / "pool.sqlite").exists()


def test_sigkill_after_a_checkpoint_resumes_from_it(tmp_path, pool_url):
    """SIGKILL of the whole process group right after the first checkpoint (CASES.md C12 on the
    real loop): the re-run continues from it to max_steps, with records that agree."""
    config = write_config(tmp_path, max_steps=3, checkpoint_every=1, pool_url=pool_url)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*FORGERL, "train", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(run_dir.glob("checkpoints/step_*/trainer_state.json")):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert survivors(tmp_path) == []  # the reaper is in its own session: it survived the kill
    result = subprocess.run([*FORGERL, "train", str(config)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    check_run_state(run_dir, max_steps=3, pool_url=pool_url)


def test_a_second_signal_exits_at_once_and_still_kills_the_agents(tmp_path):
    """The first SIGTERM starts the clean stop (agents get SIGTERM and a grace period; this
    agent ignores SIGTERM); a second one ends the process at once, and the reaper kills the
    agents."""
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text(AGENT.replace(
        "q = json", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                    "time.sleep(600)\nq = json"))
    config = write_config(tmp_path, max_steps=1)
    text = config.read_text().replace(str(tmp_path / "agent.py"), str(stubborn))
    config.write_text(text.replace("eval_size = 2", "eval_size = 0"))
    proc = subprocess.Popen([*FORGERL, "train", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while len(list((tmp_path / "pids").iterdir())) < 4 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143 and time.time() - start < 5
    assert survivors(tmp_path) == []
    assert os.environ.get("FORGERL_RUN_TOKEN") is None  # the tag is the agents', not ours
