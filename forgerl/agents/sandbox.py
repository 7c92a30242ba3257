"""A sandbox per rollout for the agent's and the environment's tool and test processes, with no
container daemon (CASES.md C24).

`Sandbox.open` makes the rollout's working directory and, as root, a cgroup per controller
(pids, memory; v1 or v2) with the limits; `wrap(argv)` is the argv that runs `argv` inside it,
through `sandbox_init.py` (see its docstring): with isolation "namespaces" each call gets its own
PID, mount and (unless `network`) network namespace with loopback only, and its last process
dies with it, whatever it did (setsid, double fork, cleared environment); with "process_group"
(not root) the call is a process group with rlimits whose processes carry the sandbox's tag in
their environment, and one that clears its environment escapes until the run's reaper.
In its own network namespace a call still reaches the ForgeRL gateway at the URL it has outside,
`http://127.0.0.1:<gateway_port>`: init relays that one port to a unix socket, and a thread here
relays the socket to the gateway; every other host port is unreachable. Every stage dies with
the process that spawned it (PR_SET_PDEATHSIG), so a SIGKILLed ForgeRL leaves no sandbox running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from forgerl.agents import sandbox_init
from forgerl.agents.reaper import kill_tagged
from forgerl.types import Limits

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxError"]
log = logging.getLogger(__name__)
INIT = Path(sandbox_init.__file__)
CGROUPS = Path("/sys/fs/cgroup")
TAG_VAR = "FORGERL_SANDBOX"  # every sandboxed process's environment: the sandbox's token
CALL_VAR = "FORGERL_SANDBOX_CALL"  # and, under `run`, its call's
OUTPUT_KEEP = 1 << 20  # characters of a run's stdout and of its stderr kept (the last ones)
GRACE_S = 1.0  # from a run's SIGTERM to its SIGKILL
DEFAULT_LIMITS = Limits()
_WARNED: set[Path] = set()  # cgroup parents whose failure was logged


class SandboxError(RuntimeError):
    """A sandbox that cannot be made as asked; the message is one line saying why."""


@dataclass(frozen=True)
class RunResult:
    """One `Sandbox.run`: returncode (negative: killed by that signal; None: could not start),
    the last OUTPUT_KEEP characters of stdout and stderr, whether the timeout ended it, and its
    wall-clock seconds."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


class Sandbox:
    """One rollout's sandbox (module docstring). `workdir`: its directory on the host (created
    by `open`, removed by `close`); `isolation`: "namespaces" or "process_group"; `alive` and
    `peak` count the sandboxes open in this process (now, and most at once since the last
    `take_peak`)."""

    alive: ClassVar[int] = 0
    peak: ClassVar[int] = 0
    _no_namespaces: ClassVar[str | None] = None  # why namespaces fail here ("" when they work)

    def __init__(self, workdir: Path, isolation: str, limits: Limits, token: str,
                 cgroups: list[Path], mounts: dict[str, Path], network: bool,
                 gateway_port: int | None) -> None:
        self.workdir, self.isolation, self.limits, self.token = workdir, isolation, limits, token
        self.cgroups, self.mounts, self.network = cgroups, mounts, network
        self.gateway_port, self.closed = gateway_port, False
        self.sock: Path | None = None
        self._listener: socket.socket | None = None
        uid = f"Uid:\t{os.getuid()}\t".encode()
        self._user_processes = 0 if cgroups or limits.processes is None else sum(
            uid in _slurp(p) for p in Path("/proc").glob("[0-9]*/status"))

    @classmethod
    def take_peak(cls) -> int:
        """The most sandboxes open at once since the last call; resets it to `alive`."""
        peak, cls.peak = cls.peak, cls.alive
        return peak

    @classmethod
    async def open(cls, parent: Path, name: str, limits: Limits = DEFAULT_LIMITS, *,
                   gateway_port: int | None = None, mounts: dict[str, Path] | None = None,
                   network: bool = False, isolation: str = "auto") -> Sandbox:
        """Make the sandbox `parent/name`, empty (what a killed run left there is removed:
        a resumed rollout must not start from its last attempt's files). `mounts`: absolute
        path inside → host directory (both created when missing: a mount point on the host is
        an empty directory, left there). `network`: the host's network instead of loopback
        only. `isolation`: "auto" (namespaces where they work, else process_group, said in one
        log line), "namespaces" or "process_group". Raises SandboxError: a bad name or mount
        path, namespaces asked for where they fail, mounts without namespaces."""
        if not name or "/" in name or name in (".", ".."):
            raise SandboxError(f"sandbox name {name!r} must be one path component")
        if isolation not in ("auto", "namespaces", "process_group"):
            raise SandboxError(f"isolation {isolation!r}: expected auto, namespaces or "
                               "process_group")
        why = await asyncio.to_thread(cls._probe) if isolation != "process_group" else "asked"
        if isolation == "namespaces" and why:
            raise SandboxError(f"isolation 'namespaces' unavailable: {why}")
        mounts = {k: Path(v).resolve() for k, v in (mounts or {}).items()}  # init runs elsewhere
        if why and mounts:
            raise SandboxError(f"mounts {sorted(mounts)} need root (mount namespace): "
                               f"process_group isolation ({why})")
        for inside in mounts:
            if not inside.startswith("/") or ".." in Path(inside).parts or inside == "/":
                raise SandboxError(f"mount point {inside!r} must be an absolute path below /")
        token = secrets.token_hex(6)
        workdir = Path(parent).resolve() / name
        shutil.rmtree(workdir, ignore_errors=True)  # a killed run's leftover: start empty
        workdir.mkdir(parents=True, exist_ok=True)
        for inside, host in mounts.items():
            host.mkdir(parents=True, exist_ok=True)
            Path(inside).mkdir(parents=True, exist_ok=True)
        box = cls(workdir, "process_group" if why else "namespaces", limits, token,
                  [] if why else _cgroups(token, limits), mounts, network, gateway_port)
        if not why and not network and gateway_port:
            box._forward()
        cls.alive += 1
        cls.peak = max(cls.peak, cls.alive)
        return box

    @classmethod
    def _probe(cls) -> str:
        """Why namespaces fail here ("" when they work); probed once per process."""
        if cls._no_namespaces is None:
            if os.geteuid() != 0:
                cls._no_namespaces = "not root"
            else:
                done = subprocess.run([sys.executable, "-I", "-S", str(INIT), "--probe"],
                                      capture_output=True, text=True)
                cls._no_namespaces = (done.stderr.strip() or f"exit {done.returncode}"
                                      if done.returncode else "")
            if cls._no_namespaces:
                log.warning("sandbox: no namespaces (%s): process group + rlimits; a process "
                            "that clears its environment escapes, the network is shared",
                            cls._no_namespaces)
        return cls._no_namespaces

    def _forward(self) -> None:
        """Listen on a unix socket and relay each connection to the gateway (a daemon thread)."""
        sock = self.workdir / ".gateway.sock"
        if len(str(sock)) > 100:  # sun_path holds 108 bytes
            sock = Path(tempfile.gettempdir()) / f"forgerl-sandbox-{self.token}.sock"
        self.sock, self._listener = sock, socket.socket(socket.AF_UNIX)
        self._listener.bind(str(sock))
        self._listener.listen(128)
        port = self.gateway_port
        threading.Thread(target=sandbox_init.relay, daemon=True, args=(
            self._listener, lambda: socket.create_connection(("127.0.0.1", port)))).start()

    def wrap(self, argv: list[str], cwd: str | None = None, env: dict[str, str] | None = None
             ) -> list[str]:
        """The argv that runs `argv` inside this sandbox with working directory `cwd` (a path
        inside; default the workdir), `env` added to the environment it is started with.
        Spawn it from this process (the sandbox dies with its spawner's thread), in a new
        session, with any host working directory. Raises SandboxError once closed."""
        if self.closed:
            raise SandboxError(f"sandbox {self.workdir} is closed")
        lim, rlimits = self.limits, {}
        if lim.cpu_s is not None:
            rlimits["CPU"] = lim.cpu_s
        if lim.file_mb is not None:
            rlimits["FSIZE"] = lim.file_mb << 20
        if lim.memory_mb is not None and not self._cgroup("memory"):
            rlimits["AS"] = lim.memory_mb << 20
        if lim.processes is not None and not self._cgroup("pids"):  # counts all the user's
            rlimits["NPROC"] = lim.processes + self._user_processes
        ns = self.isolation == "namespaces"
        opts = ["--mode", "ns" if ns else "pg", "--token", self.token, "--parent",
                str(os.getpid()), "--cwd", cwd or str(self.workdir)]
        opts += [x for c in self.cgroups for x in ("--cgroup", str(c))]
        opts += [x for k, v in rlimits.items() for x in ("--rlimit", k, str(v))]
        opts += [x for k, v in self.mounts.items() for x in ("--mount", k, str(v))]
        opts += [x for k, v in {TAG_VAR: self.token, **(env or {})}.items()
                 for x in ("--env", k, v)]
        if ns and not self.network:
            opts += ["--net", *(["--port", str(self.gateway_port), "--sock", str(self.sock)]
                                if self.sock else [])]
        return [sys.executable, "-I", "-S", str(INIT), *opts, "--", *argv]

    def _cgroup(self, controller: str) -> bool:
        """Whether this sandbox's cgroups enforce `controller`'s limit."""
        return any((c / f"{controller}.max").exists() or c.parent.name == controller
                   for c in self.cgroups)

    async def run(self, argv: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
                  cwd: str | None = None, stdin: bytes = b"") -> RunResult:
        """Run a tool or test process inside (this environment plus `env`; `cwd` inside,
        default the workdir) and return its outcome. At `timeout_s` its group gets SIGTERM,
        then SIGKILL GRACE_S later; however it ends, every process of the call dies with it
        (process_group: those still tagged with the call). Raises SandboxError once closed."""
        call = secrets.token_hex(6)
        wrapped = self.wrap(argv, cwd, {CALL_VAR: call})
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *wrapped, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})},
                cwd=self.workdir, start_new_session=True)
        except OSError as exc:
            return RunResult(None, "", f"cannot start {argv!r}: {exc}", False, 0.0)
        out, err = bytearray(), bytearray()
        readers = [asyncio.create_task(read_tail(proc.stdout, out, OUTPUT_KEEP * 4)),
                   asyncio.create_task(read_tail(proc.stderr, err, OUTPUT_KEEP * 4)),
                   asyncio.create_task(feed_stdin(proc, stdin))]
        timed_out = False
        try:
            try:
                await asyncio.wait_for(exited(proc), timeout_s)
            except TimeoutError:
                timed_out = True
                await terminate_group(proc, GRACE_S)
        finally:  # also when cancelled
            signal_group(proc.pid, signal.SIGKILL)
            if self.isolation == "process_group":  # namespaces: gone with the call's init
                await asyncio.to_thread(kill_tagged, call, var=CALL_VAR)
            await exited(proc)
            _, pending = await asyncio.wait(readers, timeout=GRACE_S)
            for reader in pending:
                reader.cancel()
        text = [b[-OUTPUT_KEEP * 4:].decode("utf-8", "replace")[-OUTPUT_KEEP:] for b in (out, err)]
        return RunResult(proc.returncode, text[0], text[1], timed_out, time.monotonic() - start)

    async def close(self) -> None:
        """SIGKILL every process inside, stop the gateway relay, remove the cgroups and the
        workdir. Idempotent."""
        if self.closed:
            return
        self.closed = True
        Sandbox.alive -= 1
        teardown = asyncio.ensure_future(self._teardown())
        try:
            await asyncio.shield(teardown)
        except asyncio.CancelledError:  # a cancelled rollout still leaves nothing behind
            await teardown
            raise

    async def _teardown(self) -> None:
        """`close`'s work; the workdir is removed until it is gone (a dying process may still
        write into it)."""
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        await asyncio.to_thread(self._kill_all)
        if self.sock is not None:
            self.sock.unlink(missing_ok=True)
        for _ in range(20):
            shutil.rmtree(self.workdir, ignore_errors=True)
            if not self.workdir.exists():
                break
            await asyncio.sleep(0.05)

    def _kill_all(self, rounds: int = 50, pause_s: float = 0.02) -> None:
        """SIGKILL the sandbox's processes (its cgroups', and those whose argv or environment
        holds its token) until none is left, then remove its cgroups."""
        needle = f"\0--token\0{self.token}\0".encode()
        for _ in range(rounds):
            pids = {int(p) for c in self.cgroups for p in _slurp(c / "cgroup.procs").split()}
            for entry in Path("/proc").glob("[0-9]*"):
                if needle in _slurp(entry / "cmdline"):
                    pids.add(int(entry.name))
            pids.discard(os.getpid())
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            tagged = kill_tagged(self.token, rounds=1, var=TAG_VAR)
            if not pids and not tagged:
                break
            time.sleep(pause_s)
        for cgroup in self.cgroups:
            for _ in range(rounds):
                with contextlib.suppress(FileNotFoundError):
                    try:
                        cgroup.rmdir()
                    except OSError:  # busy until the kernel has finished its exits
                        time.sleep(pause_s)
                        continue
                break


def _cgroups(token: str, limits: Limits) -> list[Path]:
    """The sandbox's cgroups with `limits` set: v2 one directory, v1 one per controller (pids,
    memory); [] where they cannot be made (the limits fall back to rlimits). Those of a dead
    process (SIGKILLed before `close`) are emptied (SIGKILL) and removed first."""
    name, made = f"forgerl-{os.getpid()}-{token}", []
    for stale in [*CGROUPS.glob("forgerl-*-*"), *CGROUPS.glob("*/forgerl-*-*")]:
        if not Path(f"/proc/{stale.name.split('-')[1]}").exists():  # its owner is gone:
            for pid in _slurp(stale / "cgroup.procs").split():  # so are its processes
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                stale.rmdir()
    if (CGROUPS / "cgroup.controllers").exists():  # v2
        plan = [(CGROUPS / name, {"pids.max": limits.processes, "memory.max": limits.memory_mb,
                                  "memory.swap.max": limits.memory_mb and 0})]
    else:
        plan = [(CGROUPS / "pids" / name, {"pids.max": limits.processes}),
                (CGROUPS / "memory" / name, {"memory.limit_in_bytes": limits.memory_mb,
                                             "memory.memsw.limit_in_bytes": limits.memory_mb})]
    for path, values in plan:
        if all(v is None for v in values.values()):
            continue
        try:
            path.mkdir()
            made.append(path)
            for file, value in values.items():
                if value is not None:
                    mb = file.startswith("memory") and not file.startswith("memory.swap")
                    with contextlib.suppress(FileNotFoundError):  # no swap accounting
                        (path / file).write_text(str(value << 20 if mb else value))
        except OSError as exc:
            if path.parent not in _WARNED:  # once per controller and process
                _WARNED.add(path.parent)
                log.warning("sandbox: cgroup %s unavailable (%s): rlimits instead", path, exc)
            with contextlib.suppress(OSError):
                path.rmdir()
            if made and made[-1] == path:
                made.pop()
    return made


def _slurp(path: Path) -> bytes:
    """The file's bytes; b"" when it is gone (a process that exited, a removed cgroup)."""
    try:
        return path.read_bytes()
    except OSError:
        return b""


async def read_tail(stream: asyncio.StreamReader | None, buf: bytearray, keep: int) -> None:
    """Read `stream` to EOF into `buf`, keeping only its last `keep` bytes."""
    while stream is not None and (chunk := await stream.read(65536)):
        buf += chunk
        del buf[:-keep]


async def exited(proc: asyncio.subprocess.Process, poll_s: float = 0.02) -> int:
    """The leader's exit code, as soon as it exits.

    `Process.wait()` also waits for the stdout/stderr pipes to close (Python 3.11), which a
    grandchild holding them would delay forever; the return code is set on exit itself.
    """
    while proc.returncode is None:
        await asyncio.sleep(poll_s)
    return proc.returncode


async def feed_stdin(proc: asyncio.subprocess.Process, data: bytes) -> None:
    """Write `data` to stdin and close it; a process that never reads it is fine."""
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to process group `pgid`; an already empty group is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def terminate_group(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM `proc`'s group, wait up to `grace_s` for the leader, then SIGKILL the group.

    The SIGKILL runs even if this wait is itself cancelled; asyncio's child watcher reaps the
    leader, and the final wait makes sure it has been reaped before returning.
    """
    try:
        signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(exited(proc), grace_s)
    finally:
        signal_group(proc.pid, signal.SIGKILL)
    await exited(proc)
