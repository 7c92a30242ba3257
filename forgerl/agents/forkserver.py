"""A fork server for Python command agents: import the agent's heavy modules once, fork per rollout.

A fresh `python agent.py` per rollout imports its heavy modules (e.g. `openai`) again before its
first request, once per rollout. With `[agent] preload = ["openai"]` (or preload
unset: the installed packages the script imports at its top level, `script_imports`) the runner
starts one server process per run (`python -m forgerl.agents.forkserver MODULE...`), which
imports those modules and then forks one child per rollout: the child starts a new session (its
own process group, like a spawned agent), takes the rollout's stdin / stdout / stderr (file
descriptors sent over a Unix socket, SCM_RIGHTS), environment, working directory and argv, and
runs the script as `__main__` (`runpy.run_path`). The agent program is unchanged; what it sees
differs only in modules already imported. The server is exec'd with the run's environment, so
every child carries FORGERL_RUN_TOKEN in /proc/PID/environ and the reaper finds it.

Protocol (one socket, the server's fd 3): the runner sends a JSON request `{"argv", "env",
"cwd"}` with 3 fds and gets `{"pid": N}` (or `{"error": "..."}`) back, in order; when a child
exits the server sends `{"exit": N, "code": C}` (C < 0: killed by signal -C). Single-threaded
server (fork in a threaded process is unsafe): it polls the socket and `waitpid(WNOHANG)`.
"""

from __future__ import annotations

import ast
import asyncio
import atexit
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

MAX_MSG = 1 << 20  # bytes of one request (argv + environment)


@functools.lru_cache(maxsize=64)
def script_imports(script: str) -> tuple[str, ...]:
    """The installed packages a Python agent script imports at its top level: the first name of
    each `import a.b` / `from a import b` statement in the module body (absolute imports only)
    whose package this interpreter finds under a site-packages or dist-packages directory. The
    standard library, the script's own modules and imports inside functions or `try` blocks
    are left out, so a fork server never runs code of the agent's before the agent does.
    () when the script cannot be read or parsed (the agent is then exec'd and reports it)."""
    try:
        with open(script, "rb") as f:
            body = ast.parse(f.read()).body
    except (OSError, SyntaxError, ValueError):
        return ()
    names: list[str] = []
    for node in body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return tuple(name for name in dict.fromkeys(n.split(".")[0] for n in names)
                 if name not in sys.stdlib_module_names and _installed(name))


def _installed(name: str) -> bool:
    """Whether this interpreter finds the top-level package `name` in site- or dist-packages."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    where = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), ""))
    return bool(where) and not {"site-packages", "dist-packages"}.isdisjoint(Path(where).parts)


class ForkedProcess:
    """The runner's view of one forked agent, shaped like `asyncio.subprocess.Process` where
    `runner._run_command` uses it: pid (= its process group), returncode (None until it
    exits, from the server's exit reports), stdin (StreamWriter), stdout and stderr
    (StreamReader, or None for a log file)."""

    def __init__(self, pid: int, codes: dict[int, int], stdin: asyncio.StreamWriter,
                 stdout: asyncio.StreamReader, stderr: asyncio.StreamReader | None) -> None:
        self.pid, self._codes, self.stdin, self.stdout, self.stderr = (
            pid, codes, stdin, stdout, stderr)

    @property
    def returncode(self) -> int | None:
        return self._codes.get(self.pid)


class ForkServer:
    """Runner side: `await ForkServer.start(preload, env)`, then `await spawn(...)` per rollout.

    Raises OSError from `start` when the server cannot start or a module does not import (its
    stderr's last line says which); `spawn` raises OSError when the server is gone (the runner
    then starts the agent as a plain process).
    """

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.replies: asyncio.Queue[dict] = asyncio.Queue()
        self.children: set[int] = set()  # forked, not yet reported exited
        self.codes: dict[int, int] = {}  # pid → exit code (< 0: killed by that signal)
        self.lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        self.reader = loop.create_task(self._read())

    @classmethod
    async def start(cls, preload: list[str], env: dict[str, str]) -> ForkServer:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "forgerl.agents.forkserver", str(theirs.fileno()),
                *preload, pass_fds=(theirs.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        mine.setblocking(False)
        server = cls(proc, mine)
        ready = await server.replies.get()
        if "error" in ready:
            await server.close()
            raise OSError(f"agent fork server: {ready['error']}")
        return server

    async def _read(self) -> None:
        """Dispatch the server's lines: spawn replies to the queue, exits to their process."""
        loop, buf = asyncio.get_running_loop(), b""
        with contextlib.suppress(OSError):
            while chunk := await loop.sock_recv(self.sock, 65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "exit" in msg:  # recorded by pid: it may come before spawn returns
                        self.children.discard(msg["exit"])
                        self.codes[msg["exit"]] = msg["code"]
                    else:
                        if "pid" in msg:
                            self.children.add(msg["pid"])
                        await self.replies.put(msg)
        for pid in self.children:  # the server died: its children are orphans
            self.codes.setdefault(pid, -signal.SIGKILL)
        await self.replies.put({"error": "the fork server exited"})

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None,
                    stderr_fd: int | None) -> ForkedProcess:
        """Fork `argv` (interpreter, script, args) with pipes for stdin/stdout (and stderr
        unless `stderr_fd`, a file opened for appending, is given)."""
        loop = asyncio.get_running_loop()
        pipes = [os.pipe(), os.pipe()] + ([] if stderr_fd is not None else [os.pipe()])
        child_fds = [pipes[0][0], pipes[1][1], stderr_fd if stderr_fd is not None else pipes[2][1]]
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode() + b"\n"
        child: ForkedProcess | None = None
        try:
            async with self.lock:  # one request at a time: replies come back in order
                if self.reader.done():
                    raise OSError("the agent fork server exited")
                socket.send_fds(self.sock, [request], child_fds)
                reply = await self.replies.get()
                if "pid" in reply:
                    child = ForkedProcess(reply["pid"], self.codes, *await _streams(loop, pipes))
        finally:
            for fd in (pipes[0][0], *(p[1] for p in pipes[1:])):  # the child's ends
                os.close(fd)
            if child is None:  # ours, not handed to streams
                for fd in (pipes[0][1], *(p[0] for p in pipes[1:])):
                    os.close(fd)
        if child is None:
            raise OSError(reply.get("error", "no reply"))
        return child

    async def close(self) -> None:
        """Stop the server (its children are the runner's to kill, by process group)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()
        self.reader.cancel()
        self.sock.close()


async def _streams(loop: asyncio.AbstractEventLoop, pipes: list[tuple[int, int]]):
    """(stdin writer, stdout reader, stderr reader or None) over the runner's pipe ends."""
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        os.fdopen(pipes[0][1], "wb", 0))
    stdin = asyncio.StreamWriter(transport, protocol, None, loop)
    readers = []
    for r, _ in pipes[1:]:
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda rd=reader: asyncio.StreamReaderProtocol(rd),
                                     os.fdopen(r, "rb", 0))
        readers.append(reader)
    return stdin, readers[0], readers[1] if len(readers) > 1 else None


# ---- the server process ---------------------------------------------------------------------

def _child(request: dict, fds: list[int], ready: int) -> None:
    """In the forked child: become the agent (never returns); `ready` gets one byte after
    setsid. Exits as a plain interpreter would: non-daemon threads joined, atexit run."""
    code = 1
    try:
        os.setsid()
        os.write(ready, b"x")
        os.close(ready)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own fds)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        if request["cwd"]:
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][1]
        sys.argv = request["argv"][1:]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        except BaseException as exc:  # the traceback from the script's frames on, as python's
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != os.path.abspath(script):
                tb = tb.tb_next
            traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
        with contextlib.suppress(Exception):
            threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads
            atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(sock: socket.socket) -> None:
    """Fork a child per request until the runner closes the socket; report exits. A pid is
    sent once the child has its own session, so the runner's first killpg always finds it."""
    def send(msg: dict) -> None:
        sock.sendall(json.dumps(msg).encode() + b"\n")

    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    alive: set[int] = set()
    while True:
        if sel.select(timeout=0.02):
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 3)
            if not msg:
                return
            while not msg.endswith(b"\n"):
                msg += sock.recv(MAX_MSG)
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                sel.close()
                os.close(ready_r)
                _child(json.loads(msg), fds, ready_w)
            os.close(ready_w)
            os.read(ready_r, 1)  # the child called setsid (or died)
            os.close(ready_r)
            for fd in fds:
                os.close(fd)
            alive.add(pid)
            send({"pid": pid})
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner stops it (Ctrl-C hits the group)
    try:
        for name in sys.argv[2:]:
            importlib.import_module(name)
    except BaseException as exc:
        sock.sendall(json.dumps({"error": f"cannot import: {exc!r}"}).encode() + b"\n")
        return
    sock.sendall(b'{"ready": true}\n')
    serve(sock)


if __name__ == "__main__":
    main()
