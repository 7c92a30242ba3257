"""CASES.md C24 in a sandbox: every process of a call dies with it, whatever it did to escape
(setsid, a double fork, `env -i`), the sandbox cannot reach the host's ports but the gateway's,
its limits hold, its mounts land in the host directory, and nothing is left after `close` or
after the ForgeRL process is SIGKILLed.

Real processes, real namespaces and cgroups (root; CI runs as root), a real HTTP server as the
gateway. Processes are found by a unique `sleep` duration in their argv, so one that cleared its
environment is still found.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.server
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from forgerl.agents.runner import infra_cause, run_command_agent
from forgerl.agents.sandbox import Sandbox, SandboxError
from forgerl.config import ConfigError, load_config

from .test_process_hygiene import descendants

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="namespaces and cgroups need root (CI is root)")
PY = sys.executable


def spawner(mark: str, env_i: bool = True) -> str:
    """A shell that leaves background children of every kind, then waits: plain `&`, one
    ignoring SIGTERM, one in its own session, a double fork, and (env_i) one with a cleared
    environment."""
    lines = [f"sleep {mark} &", f"sh -c 'trap \"\" TERM; sleep {mark}' &",
             f"setsid sleep {mark} &", f"( setsid sh -c 'sleep {mark} & exit 0' & )"]
    if env_i:
        lines.append(f"( env -i /bin/sh -c 'setsid sleep {mark} &' & )")
    return "\n".join([*lines, "wait"])


def new_mark() -> str:
    return f"{1000 + uuid.uuid4().int % 9000}.{uuid.uuid4().int % 10**9}"


def marked(mark: str) -> set[int]:
    """Live processes whose argv holds `mark`."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            if mark.encode() in (entry / "cmdline").read_bytes() and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                found.add(int(entry.name))
    found.discard(os.getpid())
    return found


def settle(mark: str, within_s: float = 2.0) -> set[int]:
    deadline = time.monotonic() + within_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def procs(box: Sandbox) -> list[int]:
    return [int(p) for c in box.cgroups for p in (c / "cgroup.procs").read_text().split()]


@needs_root
@pytest.mark.parametrize("isolation", ["namespaces", "process_group"])
def test_background_children_die_with_a_timed_out_run_x20(tmp_path, isolation):
    """Two waves of 10 concurrent runs with a 1 s timeout: each a timeout within 3 s, every
    process seen mid-run gone after, this test's descendants back to what they were, a sibling
    in this test's process group alive. process_group: the `env -i` child escapes by design,
    so it is left out there."""
    mark, before = new_mark(), descendants(os.getpid())
    sibling = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    seen: list[int] = []

    async def main() -> list:
        box = await Sandbox.open(tmp_path, "box", isolation=isolation)
        assert box.isolation == isolation
        results = []
        for _ in range(2):
            wave = asyncio.gather(*(box.run(["sh", "-c", spawner(mark, isolation != "process_"
                                                                 "group")], timeout_s=1.0)
                                    for _ in range(10)))
            most = 0
            while not wave.done():  # the most seen at once: the children really run
                most = max(most, len(await asyncio.to_thread(marked, mark)))
                await asyncio.sleep(0.05)
            seen.append(most)
            results += await wave
        assert procs(box) == []  # cgroup empty (process_group: no cgroups)
        await box.close()
        return results

    try:
        results = asyncio.run(main())
        assert len(results) == 20
        for result in results:
            assert result.timed_out and result.returncode == -signal.SIGTERM
            assert 1.0 <= result.seconds <= 3.0
        assert min(seen) >= 10 * (6 if isolation == "namespaces" else 5)
        assert settle(mark) == set()
        assert descendants(os.getpid()) == before | {sibling.pid}
        assert sibling.poll() is None
    finally:
        sibling.kill()
        sibling.wait()


@needs_root
def test_kill_inside_reaches_only_the_sandbox(tmp_path):
    """`kill -TERM 0` ends the call's own group; `kill -TERM -1` (every process it may signal
    but itself and PID 1) ends only the sandbox's processes: this test's sibling lives."""
    sibling = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    mark = new_mark()

    async def main() -> None:
        box = await Sandbox.open(tmp_path, "box")
        group = await box.run(["sh", "-c", f"sleep {mark} & kill -TERM 0; sleep 30"],
                              timeout_s=10)
        assert group.returncode == -signal.SIGTERM and not group.timed_out
        everyone = await box.run(["sh", "-c", f"setsid sleep {mark} & [ $$ = 2 ] || exit 9; "
                                  "echo pid $$; kill -TERM -1; wait $!; echo status $?"],
                                 timeout_s=10)
        # the shell is PID 2 under the sandbox's init; kill -1 spares it and init
        assert everyone.stdout == "pid 2\nstatus 143\n"
        assert everyone.returncode == 0 and everyone.seconds < 3
        await box.close()

    try:
        asyncio.run(main())
        assert settle(mark) == set() and sibling.poll() is None
    finally:
        sibling.kill()
        sibling.wait()


def _init_of(box: Sandbox, parent: int) -> int:
    """The sandbox init of the one wrapped call spawned by `parent` (its outer stage's child)."""
    for _ in range(200):
        outers = [p for p in descendants(parent)
                  if box.token.encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
        inits = [p for p in outers if int(Path(f"/proc/{p}/stat").read_text()
                                          .rsplit(")", 1)[1].split()[1]) in outers]
        if inits:
            return inits[0]
        time.sleep(0.02)
    raise AssertionError("no sandbox init found")


@needs_root
def test_an_external_sandbox_kill_is_an_infrastructure_abort(tmp_path):
    """SIGKILL of the sandbox's init from outside while the agent runs: the episode fails with
    -SIGKILL, which `infra_cause` reports; an agent's own failure in a sandbox is no abort."""
    mark = new_mark()

    async def main() -> None:
        box = await Sandbox.open(tmp_path, "box")
        episode = asyncio.create_task(run_command_agent(
            ["sh", "-c", f"sleep {mark}"], {"q": 1}, "http://127.0.0.1:9/v1", "k", 30,
            sandbox=box))
        init = await asyncio.to_thread(_init_of, box, os.getpid())
        while not marked(mark):
            await asyncio.sleep(0.02)
        os.kill(init, signal.SIGKILL)
        result = await episode
        assert result.status == "failed" and result.returncode == -signal.SIGKILL
        assert infra_cause(result) == (
            "agent killed by SIGKILL from outside (OOM killer, sandbox or operator)")
        own = await run_command_agent(["sh", "-c", "pwd; exit 3"], {}, "u", "k", 30,
                                      sandbox=box)
        assert own.returncode == 3 and infra_cause(own) is None
        answer = await run_command_agent(["sh", "-c", "cat; echo; pwd"], {"q": 1}, "u", "k",
                                         30, sandbox=box)
        assert answer.status == "finished" and answer.answer == str(box.workdir)
        await box.close()

    asyncio.run(main())
    assert settle(mark) == set()


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"gateway says hi")

    def log_message(self, *args) -> None:
        pass


PROBE = textwrap.dedent("""
    import socket, sys, urllib.request
    print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=2).close()
        print("other port reachable")
    except OSError as exc:
        print("other port refused", type(exc).__name__)
""")


@needs_root
def test_network_reaches_only_the_gateway_port(tmp_path):
    """Inside, the gateway (a real HTTP server on 127.0.0.1:G) answers at the URL it has
    outside; a host TCP server on 127.0.0.1:P is refused. With network=True P is reached."""
    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    other = socket.create_server(("127.0.0.1", 0))
    port, other_port = gateway.server_address[1], other.getsockname()[1]

    async def main() -> tuple[str, str]:
        boxed = await Sandbox.open(tmp_path, "boxed", gateway_port=port)
        shared = await Sandbox.open(tmp_path, "shared", gateway_port=port, network=True)
        argv = [PY, "-c", PROBE, f"http://127.0.0.1:{port}/v1/models", str(other_port)]
        runs = [await box.run(argv, timeout_s=20) for box in (boxed, shared)]
        await boxed.close()
        await shared.close()
        assert boxed.sock is not None and not boxed.sock.exists()
        return runs[0].stdout, runs[1].stdout

    try:
        inside, host = asyncio.run(main())
    finally:
        gateway.shutdown()
        other.close()
    assert inside == "gateway says hi\nother port refused ConnectionRefusedError\n"
    assert host == "gateway says hi\nother port reachable\n"


HOGS = {
    "file": "open('big', 'wb').write(b'x' * (2 << 20))",
    "fork": textwrap.dedent("""
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as exc:
            print(n, exc.errno)
    """),
    "memory": "x = bytearray(256 << 20); x[::4096] = b'y' * len(x[::4096]); print('survived')",
    "cpu": "while True: pass",
}


@needs_root
@pytest.mark.parametrize("isolation", ["namespaces", "process_group"])
def test_limits_hold(tmp_path, isolation):
    """file_mb=1: a 2 MB write fails with EFBIG; processes=12: a fork loop stops at EAGAIN
    (namespaces: the cgroup counts the whole sandbox; process_group: RLIMIT_NPROC, which root
    ignores, so left out there); memory_mb=64: a 256 MB hog is killed (SIGKILL by the cgroup's
    OOM killer, or MemoryError under RLIMIT_AS); cpu_s=1: a busy loop dies of SIGXCPU."""
    limits = load_config(None, ["--sandbox.cpu_s", "1", "--sandbox.memory_mb", "64",
                                "--sandbox.processes", "12", "--sandbox.file_mb", "1"]
                         ).sandbox.limits()

    async def main() -> dict:
        box = await Sandbox.open(tmp_path, "box", limits, isolation=isolation)
        out = {k: await box.run([PY, "-c", code], timeout_s=20) for k, code in HOGS.items()
               if not (k == "fork" and isolation == "process_group")}
        await box.close()
        return out

    out = asyncio.run(main())
    assert f"[Errno {errno.EFBIG}] File too large" in out["file"].stderr
    assert (tmp_path / "box").exists() is False
    if isolation == "namespaces":
        forked, code = map(int, out["fork"].stdout.split())
        assert code == errno.EAGAIN and 5 <= forked <= 12 - 3  # outer, init, the python
        assert out["memory"].returncode == -signal.SIGKILL
    else:
        assert out["memory"].returncode == 1 and "MemoryError" in out["memory"].stderr
    assert "survived" not in out["memory"].stdout
    assert out["cpu"].returncode == -signal.SIGXCPU and out["cpu"].seconds < 10


@needs_root
def test_mounts_land_in_the_host_directory(tmp_path):
    """A file written to /app inside lands in the host directory; the host's /app is left as
    it was (created empty as a mount point when missing)."""
    existed = {p for p in ("/app", "/tests") if Path(p).exists()}
    before = sorted(os.listdir("/app")) if "/app" in existed else []
    host = tmp_path / "task-app"

    async def main() -> str:
        box = await Sandbox.open(tmp_path, "box", mounts={"/app": host, "/tests": tmp_path / "t"})
        run = await box.run(["sh", "-c", "echo made > /app/out.txt; pwd; ls /tests"],
                            timeout_s=10, cwd="/app")
        await box.close()
        return run.stdout

    try:
        assert asyncio.run(main()) == "/app\n"
        assert (host / "out.txt").read_text() == "made\n"
        assert sorted(os.listdir("/app")) == before
    finally:
        for made in {"/app", "/tests"} - existed:
            with contextlib.suppress(OSError):
                os.rmdir(made)


def test_a_sandbox_starts_empty_over_a_killed_runs_leftover(tmp_path):
    """A SIGKILLed run leaves RUN_DIR/sandboxes/NAME behind; the resumed rollout's sandbox of
    the same name must not start from its last attempt's files (a Harbor task half done)."""
    left = tmp_path / "box" / "fs" / "app"
    left.mkdir(parents=True)
    (left / "done.txt").write_text("the killed attempt's work\n")

    async def main() -> tuple[str, bool]:
        box = await Sandbox.open(tmp_path, "box", isolation="process_group")
        run = await box.run(["sh", "-c", "ls -A"], timeout_s=10)
        await box.close()
        return run.stdout, box.workdir.exists()

    assert asyncio.run(main()) == ("", False)


def test_process_group_refuses_mounts_and_bad_names(tmp_path):
    with pytest.raises(ConfigError, match=r"sandbox\.isolation"):
        load_config(None, ["--sandbox.isolation", "docker"])
    start = Sandbox.alive

    async def main() -> None:
        with pytest.raises(SandboxError, match=r"needs? root \(mount namespace\)"):
            await Sandbox.open(tmp_path, "box", mounts={"/app": tmp_path},
                               isolation="process_group")
        with pytest.raises(SandboxError, match="one path component"):
            await Sandbox.open(tmp_path, "../x")
        with pytest.raises(SandboxError, match="absolute path"):
            await Sandbox.open(tmp_path, "box", mounts={"app": tmp_path})
    asyncio.run(main())
    assert Sandbox.alive == start


@pytest.mark.parametrize("isolation", ["auto", "process_group"])
def test_close_kills_everything_and_removes_everything(tmp_path, isolation):
    """A wrapped call left running (spawned by hand, not by `run`) dies at `close`; the workdir
    and the cgroups are gone; a second close is a no-op; `alive` and `take_peak` count."""
    mark, start = new_mark(), Sandbox.alive

    async def main() -> None:
        boxes = [await Sandbox.open(tmp_path, f"box{i}", isolation=isolation) for i in range(3)]
        assert Sandbox.alive == start + 3 and Sandbox.take_peak() == start + 3
        box = boxes[0]
        proc = subprocess.Popen(box.wrap(["sh", "-c", f"setsid sleep {mark} & sleep {mark}"]),
                                start_new_session=True)
        while len(marked(mark)) < 2:
            await asyncio.sleep(0.02)
        for b in boxes:
            await b.close()
        await box.close()
        assert proc.wait(5) == -signal.SIGKILL
        assert not box.workdir.exists() and not any(c.exists() for c in box.cgroups)
        assert Sandbox.alive == start and Sandbox.take_peak() == start + 3
        assert Sandbox.take_peak() == start
        with pytest.raises(SandboxError, match="closed"):
            box.wrap(["true"])

    asyncio.run(main())
    assert settle(mark) == set()


@needs_root
def test_a_sigkilled_forgerl_leaves_no_sandbox_running(tmp_path):
    """The process that opened the sandbox and runs a call in it is SIGKILLed: every process
    of the call (a setsid and an `env -i` one too) dies within 2 s."""
    mark = new_mark()
    script = textwrap.dedent(f"""
        import asyncio
        from pathlib import Path
        from forgerl.agents.sandbox import Sandbox
        async def main():
            box = await Sandbox.open(Path({str(tmp_path)!r}), "box")
            print("open", flush=True)
            await box.run(["sh", "-c", {spawner(mark)!r}], timeout_s=60)
        asyncio.run(main())
    """)
    forgerl = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    try:
        assert forgerl.stdout is not None and forgerl.stdout.readline() == b"open\n"
        deadline = time.monotonic() + 10
        while len(marked(mark)) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(marked(mark)) >= 6
    finally:
        forgerl.kill()
        forgerl.wait()
    assert settle(mark) == set()


SYSTEM_PY = "/usr/bin/python3.11"  # this venv's interpreter may sit in root's home


@needs_root
@pytest.mark.skipif(not Path(SYSTEM_PY).exists(), reason=f"needs {SYSTEM_PY} for user nobody")
def test_without_root_the_fallback_says_so_and_still_kills_the_call():
    """As `nobody` (setpriv), "auto" falls back to process_group with one log line naming why;
    a timed-out call's setsid child still dies (it keeps the tag) and `close` cleans up."""
    mark, parent = new_mark(), Path(tempfile.mkdtemp())  # tmp_path's parents are root's only
    parent.chmod(0o777)
    script = textwrap.dedent(f"""
        import asyncio, logging
        from pathlib import Path
        from forgerl.agents.sandbox import Sandbox
        logging.basicConfig(format="%(message)s")
        async def main():
            box = await Sandbox.open(Path({str(parent)!r}), "box")
            result = await box.run(["sh", "-c", "setsid sleep {mark} & sleep {mark}"],
                                   timeout_s=1)
            await box.close()
            print(box.isolation, result.timed_out, box.workdir.exists())
        asyncio.run(main())
    """)
    try:
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               SYSTEM_PY, "-c", script], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    finally:
        shutil.rmtree(parent)
    assert done.stdout == "process_group True False\n", done.stderr
    assert done.stderr.startswith("sandbox: no namespaces (not root): process group + rlimits")
    assert done.stderr.count("\n") == 1
    assert settle(mark) == set()


@needs_root
def test_a_dead_runs_cgroup_is_emptied_and_removed_by_the_next_open(tmp_path):
    """Processes left in the cgroup of a ForgeRL process that died (SIGKILL before `close`)
    are killed, and the cgroup removed, when a sandbox opens next."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    stale = Path(f"/sys/fs/cgroup/pids/forgerl-{dead.pid}-deadbeef0000")
    if not stale.parent.is_dir():
        pytest.skip("no cgroup v1 pids controller on this machine")
    stale.mkdir()
    left = subprocess.Popen(["sleep", "60"])
    (stale / "cgroup.procs").write_text(str(left.pid))

    async def open_and_close():
        box = await Sandbox.open(tmp_path, "next")
        await box.close()

    asyncio.run(open_and_close())
    assert left.wait(timeout=5) == -signal.SIGKILL
    asyncio.run(open_and_close())  # the killed process has left it: this open removes it
    assert not stale.exists()


@needs_root
def test_a_relative_mount_source_is_the_callers_path(tmp_path, monkeypatch):
    """A relative host path (a relative run_dir, as in `run_dir = "runs/x"`) names the
    caller's directory, not one relative to where the sandbox's init runs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel" / "app").mkdir(parents=True)

    async def main():
        box = await Sandbox.open(Path("boxes"), "b", mounts={"/app": Path("rel/app")})
        try:
            return await box.run(["sh", "-c", "echo hi > /app/x"], timeout_s=10)
        finally:
            await box.close()

    assert asyncio.run(main()).returncode == 0
    assert (tmp_path / "rel" / "app" / "x").read_text() == "hi\n"
