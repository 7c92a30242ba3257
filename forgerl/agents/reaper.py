"""The agent reaper: a watchdog process that kills every agent process of a run once the run's
process is gone, however it ended (SIGKILL and OOM kills included), so orphans are impossible.

Every command agent is started with `FORGERL_RUN_TOKEN=<token>` in its environment, which its
own children inherit. The first `Reaper.env()` call launches `python -m forgerl.agents.reaper
TOKEN` in its own session (a signal to the run's process group does not reach it) with a pipe on
its stdin. The reaper waits for that pipe to close (the kernel closes it when the run's process
dies, for any reason) or for its parent to change (the run died while a forked child of it still
holds the pipe), then sends SIGKILL, until none is left, to every process whose environment holds
the token: the agents, their children, and children that left the agent's process group. Linux
only (reads /proc); elsewhere `kill_tagged` finds nothing. A process that cleared its
environment escapes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV_VAR = "FORGERL_RUN_TOKEN"


def tagged_pids(token: str, var: str = ENV_VAR) -> list[int]:
    """Pids of the processes (not this one) whose environment holds `var`=token."""
    needle = f"{var}={token}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return [pid for pid in found if pid != os.getpid()]


def kill_tagged(token: str, rounds: int = 20, pause_s: float = 0.05, var: str = ENV_VAR) -> int:
    """SIGKILL every process tagged with `token` (in variable `var`; the runner tags each
    episode with its own), repeating (up to `rounds` times, `pause_s` seconds apart) while new
    ones appear (a child forked meanwhile); returns how many were signalled. Zombies are dead
    already: init or their parent reaps them."""
    killed: set[int] = set()
    for _ in range(rounds):
        alive = [p for p in tagged_pids(token, var) if p not in killed and not _zombie(p)]
        if not alive:
            break
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(pause_s)
    return len(killed)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


class Reaper:
    """The run's handle on its reaper process; `token` tags the agents it will kill.

    `env()` is what an agent's environment must include. `close()` (normal shutdown) stops the
    reaper after it has killed any tagged process left; without it the kernel does the same when
    this process dies.
    """

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self._proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """{ENV_VAR: token}; starts the reaper process on first use."""
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "forgerl.agents.reaper", self.token],
                stdin=subprocess.PIPE, start_new_session=True, close_fds=True)
        return {ENV_VAR: self.token}

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the pipe and wait (at most `timeout_s`) for the reaper's sweep; idempotent."""
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout_s)
            self._proc = None


def _main(token: str, poll_s: float = 0.5) -> None:
    """Watch until stdin closes or the parent changes (the run died while a forked child of it,
    e.g. a reward scorer, still holds the pipe), then kill the tagged processes."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the run's end ends the watch
    parent = os.getppid()
    while os.getppid() == parent:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], poll_s)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    kill_tagged(token)


if __name__ == "__main__":
    _main(sys.argv[1])
