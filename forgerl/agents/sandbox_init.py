"""The process a sandboxed command starts as (forgerl/agents/sandbox.py builds its argv); stdlib
only, run as `python -I -S sandbox_init.py SPEC -- ARGV...` with SPEC a JSON object.

mode "pg" (no root): die with the spawning process (PR_SET_PDEATHSIG), set the rlimits, tag the
environment, chdir and exec ARGV.
mode "ns" (root): the *outer* stage dies with the spawning process, joins the sandbox's cgroups,
unshares the mount, PID and (unless `network`) network namespaces, makes every mount private,
bind-mounts `mounts`, brings loopback up, listens on 127.0.0.1:`port` inside the new network
namespace, and forks the *init* stage: PID 1 of the new PID namespace, which dies with the outer
stage, mounts its own /proc, relays connections to that port to the unix socket `sock` (the host
side forwards them to the gateway), forks ARGV in its own process group, forwards SIGTERM,
SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to that group, reaps every orphan, and exits when
ARGV exits: the kernel then SIGKILLs every process left in the namespace (a setsid, double fork
or cleared environment does not escape a PID namespace). The outer stage forwards the same
signals to init, and exits as ARGV did (a signal death is re-raised); a SIGKILLed init is
reported as a SIGKILL. The probe `python sandbox_init.py --probe` exits 0 when namespaces work.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import threading

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int) -> None:
    _check(_libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags,
                       None), f"mount {target}")


def _die_with_parent() -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")


def _loopback_up() -> None:
    """`ip link set lo up` through SIOCGIFFLAGS / SIOCSIFFLAGS on a struct ifreq."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0)))
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags[1] | 1))  # IFF_UP


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy `src` to `dst` until EOF or an error, then half-close `dst`."""
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def relay(listener: socket.socket, connect) -> None:
    """Accept on `listener` until it is shut down; join each connection to `connect()` both ways
    (a thread per direction)."""
    def join(conn: socket.socket) -> None:
        try:
            peer = connect()
        except OSError:
            conn.close()
            return
        back = threading.Thread(target=pump, args=(peer, conn), daemon=True)
        back.start()
        pump(conn, peer)
        back.join()
        conn.close()
        peer.close()

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=join, args=(conn,), daemon=True).start()


def _exec(spec: dict, argv: list[str]) -> None:
    """In the forked (or, mode pg, the only) process: limits, environment, cwd, exec ARGV."""
    try:
        for name, value in spec["rlimits"].items():
            hard = value + 1 if name == "CPU" else value  # SIGXCPU at the soft, SIGKILL 1 s on
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, hard))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, *FORWARDED):  # as subprocess restores them
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"sandbox: cannot run {argv[0]!r} in {spec['cwd']}: {exc}\n".encode())
    os._exit(127)


def _exit_as(status: int) -> None:
    """Exit as a process with wait status `status` did: re-raise its signal, or its code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _init(spec: dict, argv: list[str], listener: socket.socket | None, status_w: int,
          life_r: int) -> None:
    """PID 1 of the sandbox (module docstring); never returns."""
    _die_with_parent()
    if select.select([life_r], [], [], 0)[0]:  # the outer stage died before the prctl
        os._exit(137)
    os.setpgid(0, 0)  # a signal to the outer stage's group reaches init once, by forwarding
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    child, pending = 0, []

    def forward(sig: int, _frame) -> None:
        if child:
            with contextlib.suppress(OSError):
                os.killpg(child, sig)
        else:
            pending.append(sig)

    for sig in FORWARDED:  # PID 1 only receives the signals it handles
        signal.signal(sig, forward)
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)
        _exec(spec, argv)
    for sig in pending:
        forward(sig, None)
    if listener is not None:
        def connect() -> socket.socket:
            peer = socket.socket(socket.AF_UNIX)
            peer.connect(spec["sock"])
            return peer

        threading.Thread(target=relay, args=(listener, connect), daemon=True).start()
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os.write(status_w, str(status).encode())
            os._exit(0)


def _outer(spec: dict, argv: list[str]) -> None:
    """The stage the spawning process sees (module docstring); never returns."""
    for cgroup in spec["cgroups"]:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | (0 if spec["network"] else CLONE_NEWNET)),
           "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for inside, host in spec["mounts"]:
        _mount(host, inside, None, MS_BIND | MS_REC)
    listener = None
    if not spec["network"]:
        _loopback_up()
        if spec["port"]:
            listener = socket.create_server(("127.0.0.1", spec["port"]), backlog=128)
    status_r, status_w = os.pipe()
    life_r, life_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        os.close(life_w)
        _init(spec, argv, listener, status_w, life_r)
    os.close(status_w)
    if listener is not None:
        listener.close()
    def forward(sig: int, _frame) -> None:
        with contextlib.suppress(OSError):
            os.kill(init, sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    _, status = os.waitpid(init, 0)
    reported = os.read(status_r, 32)
    _exit_as(int(reported) if reported else status)


def main(args: list[str]) -> None:
    if args == ["--probe"]:
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET), "unshare")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        return
    spec, argv = json.loads(args[0]), args[2:]
    _die_with_parent()
    if os.getppid() != spec["parent"]:  # the spawning process died before the prctl
        os._exit(137)
    try:
        if spec["mode"] == "pg":
            _exec(spec, argv)
        _outer(spec, argv)
    except OSError as exc:
        os.write(2, f"sandbox: {exc}\n".encode())
        os._exit(75)  # runner.INFRA_EXIT: the sandbox failed, not the command


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except OSError as exc:
        print(f"sandbox: {exc}", file=sys.stderr)
        sys.exit(1)
