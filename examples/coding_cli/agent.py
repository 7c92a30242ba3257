"""The coding-CLI agent: one rollout = one unmodified Pi (`pi -p`) session on a tiny file task.

It imports nothing from ForgeRL. One episode:

1. read the task (`FORGERL_TASK` JSON, or stdin; only its "question" is used);
2. make a fresh temporary directory holding `work/` (the rollout's working directory, with the
   task's starting files from `tasks.workspace`) and `pi/` (Pi's config: `models.json` with one
   provider whose base URL, key and model are OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL,
   spoken over Chat Completions; `settings.json` with compaction's reserve fitted to an 8k
   window, Pi's retries off);
3. run `pi --mode json -p QUESTION` on `work/` (bind-mounted at FIXED_WORK where `unshare`
   allows, so every rollout's Pi sees the same directory; its own process group), counting
   turns and tool calls in Pi's JSON event stream; after FORGERL_MAX_TURNS turns, or
   FORGERL_PI_TIMEOUT_S seconds, the group is killed (the files stay as Pi left them);
4. run the task's check script (`tasks.check_script`) with `work/` as its current directory and
   print `pass` or `fail` as the last stdout line (the reward, by the task file's `score`);
5. remove the temporary directory.

A summary line goes to stderr: `turns N tool_calls M pi (exit C|max_turns|timeout) check
pass|fail: reason`.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL (default "policy"),
FORGERL_MAX_TURNS (default 3), FORGERL_MAX_TOKENS (Pi's maxTokens, default 128),
FORGERL_PI_TIMEOUT_S (default 240), FORGERL_PI (the pi executable; default the repository's
harnesses/node_modules/.bin/pi, else `pi` on PATH).

Run by hand against a running `forgerl gateway` (OPENAI_BASE_URL = its /v1 URL, OPENAI_API_KEY
= a session key from POST /v1/sessions):
    echo '{"question": "Delete the file old.txt."}' | python examples/coding_cli/agent.py
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tasks  # the task file next to this script

REPO_PI = Path(__file__).resolve().parents[2] / "harnesses" / "node_modules" / ".bin" / "pi"
FIXED_WORK: Path | None = Path(tempfile.gettempdir()) / "forgerl-coding-cli" / "work"
"""Where Pi runs: the rollout's directory is bind-mounted here in a private mount namespace
(`unshare`), so Pi's system prompt ("Current working directory: ...") is the same in every
rollout, as in a container per rollout; None (or no `unshare`): Pi runs in the rollout's own
temporary directory."""


def pi_executable() -> str:
    """FORGERL_PI, else the repository's pinned Pi, else `pi` on PATH."""
    return os.environ.get("FORGERL_PI") or (str(REPO_PI) if REPO_PI.exists() else "pi")


def write_pi_config(config_dir: Path, base_url: str, api_key: str, model: str,
                    max_tokens: int, context_window: int = 8192) -> None:
    """Pi's `models.json` (provider "forgerl": the gateway over Chat Completions, one model)
    and `settings.json` in `config_dir` (Pi's PI_CODING_AGENT_DIR)."""
    config_dir.mkdir(parents=True, exist_ok=True)
    provider = {"baseUrl": base_url, "api": "openai-completions", "apiKey": api_key,
                "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
                "models": [{"id": model, "contextWindow": context_window,
                            "maxTokens": max_tokens}]}
    (config_dir / "models.json").write_text(json.dumps({"providers": {"forgerl": provider}}))
    settings = {"compaction": {"reserveTokens": 1024}, "retry": {"enabled": False},
                "quietStartup": True}
    (config_dir / "settings.json").write_text(json.dumps(settings))


def private_mount(work: Path) -> Path | None:
    """FIXED_WORK (created, empty) when `unshare` can bind-mount `work` there in a new user and
    mount namespace on this machine, else None (with a note on stderr)."""
    if FIXED_WORK is None or shutil.which("unshare") is None:
        return None
    FIXED_WORK.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "mount", "--bind",
                            str(work), str(FIXED_WORK)], capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"no private mount ({probe.stderr.strip()[:200]}); Pi runs in {work}",
              file=sys.stderr)
        return None
    return FIXED_WORK


def run_pi(question: str, work: Path, config_dir: Path, model: str, max_turns: int,
           timeout_s: float) -> tuple[int, int, str]:
    """Run `pi -p question` on the files in `work` (at `private_mount(work)` when there is one)
    until it exits, `max_turns` turns have ended or `timeout_s` passed (then its process group
    is killed). Returns (turns, tool calls, how Pi ended: "exit N", "max_turns" or
    "timeout")."""
    env = {**os.environ, "PI_CODING_AGENT_DIR": str(config_dir), "PI_OFFLINE": "1",
           "PI_TELEMETRY": "0", "PI_SKIP_VERSION_CHECK": "1"}
    command = [pi_executable(), "--provider", "forgerl", "--model", model, "--no-session",
               "--no-context-files", "--no-skills", "--no-extensions", "--no-prompt-templates",
               "--mode", "json", "-p", question]
    cwd: Path | None = work
    if (fixed := private_mount(work)) is not None:  # the same working directory every time
        command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                   'mount --bind "$1" "$2" && cd "$2" && shift 2 && exec "$@"', "sh", str(work),
                   str(fixed),
                   *command]
        cwd = None
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    timed_out = threading.Event()
    timer = threading.Timer(timeout_s, lambda: (timed_out.set(), _kill_group(proc.pid)))
    timer.start()
    turns = calls = 0
    stopped = False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("type") == "tool_execution_start":
                calls += 1
                print(f"tool {event.get('toolName')} {json.dumps(event.get('args'))[:200]}",
                      file=sys.stderr)
            elif event.get("type") == "turn_end":
                turns += 1
                message = event.get("message") or {}
                if message.get("stopReason") == "error":  # e.g. the server's 4xx, as Pi saw it
                    print(f"pi: {str(message.get('errorMessage'))[:300]}", file=sys.stderr)
                if turns >= max_turns:
                    stopped = True
                    _kill_group(proc.pid)
    finally:
        timer.cancel()
        code = proc.wait()
        _kill_group(proc.pid)  # no leftover children
    return turns, calls, ("max_turns" if stopped else "timeout" if timed_out.is_set()
                          else f"exit {code}")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def check(question: str, work: Path, script_dir: Path) -> tuple[bool, str]:
    """Run the task's check script with `work` as its current directory: (passed, reason)."""
    script = script_dir / "check.py"
    script.write_text(tasks.check_script(question))
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=work, capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False, "check timed out"
    return done.returncode == 0, done.stderr.strip()[-300:]


def episode(question: str, base_url: str, api_key: str, model: str, max_turns: int,
            max_tokens: int, timeout_s: float) -> bool:
    """One rollout in a fresh temporary directory (removed after); whether the check passed."""
    root = Path(tempfile.mkdtemp(prefix="pi-"))
    try:
        work = root / "work"
        work.mkdir()
        for name, text in tasks.workspace(question).items():
            (work / name).write_text(text)
        write_pi_config(root / "pi", base_url, api_key, model, max_tokens)
        turns, calls, ended = run_pi(question, work, root / "pi", model, max_turns, timeout_s)
        passed, reason = check(question, work, root)
        print(f"turns {turns} tool_calls {calls} pi {ended} check "
              f"{'pass' if passed else 'fail'}: {reason}", file=sys.stderr)
        return passed
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    task = json.loads(os.environ.get("FORGERL_TASK") or sys.stdin.read())
    passed = episode(
        task["question"],
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        model=os.environ.get("OPENAI_MODEL", "policy"),
        max_turns=int(os.environ.get("FORGERL_MAX_TURNS", "3")),
        max_tokens=int(os.environ.get("FORGERL_MAX_TOKENS", "128")),
        timeout_s=float(os.environ.get("FORGERL_PI_TIMEOUT_S", "240")),
    )
    print("pass" if passed else "fail")


if __name__ == "__main__":
    main()
