"""The process a sandboxed command starts as (forgerl/agents/sandbox.py builds its argv); stdlib
only, run as `python -I -S sandbox_init.py OPTIONS -- ARGV...` (OPTIONS: `parse`).

mode "pg" (no root): die with the spawning process (PR_SET_PDEATHSIG), set the rlimits, add to
the environment, chdir and exec ARGV.
mode "ns" (root): the *outer* stage dies with the spawning process, joins the sandbox's cgroups,
unshares the mount, PID and (with `--net`) network namespaces, makes every mount private,
bind-mounts `--mount`s, brings loopback up, listens on 127.0.0.1:`--port` inside the new network
namespace, and forks the *init* stage: PID 1 of the new PID namespace, which dies with the outer
stage, mounts its own /proc, relays connections to that port to the unix socket `--sock` (the
host side forwards them to the gateway), forks ARGV in its own process group, forwards SIGTERM,
SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to that group, reaps every orphan, and exits when
ARGV exits: the kernel then SIGKILLs every process left in the namespace (a setsid, double fork
or cleared environment does not escape a PID namespace). The outer stage forwards the same
signals to init, and exits as ARGV did (a signal death is re-raised); a SIGKILLed init is
reported as a SIGKILL. The probe `python sandbox_init.py --probe` exits 0 when namespaces work.
Every start costs an interpreter start, so the module imports only what starts fast (no json,
no enum, hence `_signal` and `_socket`).
"""

from __future__ import annotations

import _signal as signal  # the signal module imports enum: tens of ms on every sandboxed start
import _socket  # socket imports selectors and enum
import _thread  # threading imports functools and more
import ctypes
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
ARITY = {"--rlimit": 2, "--mount": 2, "--env": 2, "--net": 0}  # else 1
LISTS = ("--cgroup", "--rlimit", "--mount", "--env")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]


def parse(args: list[str]) -> tuple[dict, list[str]]:
    """OPTIONS -- ARGV into ({option: value}, ARGV). Options: --mode ns|pg, --token T (only to
    find the process), --parent PID, --cwd DIR, --port N, --sock PATH, --net (own network
    namespace), and the repeatable --cgroup DIR, --rlimit NAME N, --mount INSIDE HOST,
    --env NAME VALUE (lists, of tuples where two)."""
    spec: dict = {key: [] for key in LISTS}
    i = 0
    while args[i] != "--":
        key, n = args[i], ARITY.get(args[i], 1)
        value = True if n == 0 else args[i + 1] if n == 1 else tuple(args[i + 1:i + 3])
        spec[key].append(value) if key in LISTS else spec.__setitem__(key, value)
        i += 1 + n
    return spec, args[i + 1:]


def _quietly(fn, *args) -> None:
    """fn(*args), an OSError ignored (contextlib.suppress would import functools at every
    start)."""
    try:  # noqa: SIM105
        fn(*args)
    except OSError:
        pass


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
    """`ip link set lo up`: SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP, on a struct ifreq."""
    fd = _libc.socket(2, 2, 0)  # AF_INET, SOCK_DGRAM
    ifreq = ctypes.create_string_buffer(b"lo", 40)
    try:
        _check(_libc.ioctl(fd, 0x8913, ifreq), "SIOCGIFFLAGS lo")
        ifreq[16] = bytes([ifreq[16][0] | 1])
        _check(_libc.ioctl(fd, 0x8914, ifreq), "SIOCSIFFLAGS lo")
    finally:
        os.close(fd)


def pump(src, dst) -> None:
    """Copy socket `src` to socket `dst` until EOF or an error, then half-close `dst`."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _quietly(dst.shutdown, 1)  # SHUT_WR


def relay(listener, connect) -> None:
    """Accept on socket `listener` until it is shut down; join each connection to `connect()`
    both ways (a thread per direction)."""
    import threading  # lazy: only a relaying sandbox pays for the import

    def join(conn) -> None:
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


def _serve(fd: int, sock: str) -> None:
    """Relay the listening socket `fd` to the unix socket `sock` (init's relay thread)."""
    import socket  # lazy: imported after the command has started

    def connect():
        peer = socket.socket(socket.AF_UNIX)
        peer.connect(sock)
        return peer

    relay(socket.socket(fileno=fd), connect)


def _exec(spec: dict, argv: list[str]) -> None:
    """In the forked (or, mode pg, the only) process: limits, environment, cwd, exec ARGV."""
    try:
        for name, value in spec["--rlimit"]:
            hard = int(value) + 1 if name == "CPU" else int(value)  # SIGKILL a second on
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(value), hard))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, *FORWARDED):  # as subprocess restores them
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(spec["--env"])
        os.chdir(spec["--cwd"])
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"sandbox: cannot run {argv[0]!r} in {spec['--cwd']}: {exc}\n".encode())
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


def _init(spec: dict, argv: list[str], listener, status_w: int, life_r: int) -> None:
    """PID 1 of the sandbox (module docstring); never returns."""
    _die_with_parent()
    os.set_blocking(life_r, False)
    try:
        if not os.read(life_r, 1):  # EOF: the outer stage died before the prctl
            os._exit(137)
    except BlockingIOError:
        pass
    os.setpgid(0, 0)  # a signal to the outer stage's group reaches init once, by forwarding
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    child, pending = 0, []

    def forward(sig: int, _frame) -> None:
        _quietly(os.killpg, child, sig) if child else pending.append(sig)

    for sig in FORWARDED:  # PID 1 only receives the signals it handles
        signal.signal(sig, forward)
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)
        _exec(spec, argv)
    for sig in pending:
        forward(sig, None)
    if listener is not None:  # the command starts meanwhile: connections wait in the backlog
        _thread.start_new_thread(_serve, (listener.detach(), spec["--sock"]))
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os.write(status_w, str(status).encode())
            os._exit(0)


def _outer(spec: dict, argv: list[str]) -> None:
    """The stage the spawning process sees (module docstring); never returns."""
    for cgroup in spec["--cgroup"]:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWNET if "--net" in spec else 0)),
           "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for inside, host in spec["--mount"]:
        _mount(host, inside, None, MS_BIND | MS_REC)
    listener = None
    if "--net" in spec:
        _loopback_up()
        if "--port" in spec:
            listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", int(spec["--port"])))
            listener.listen(128)
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

    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: _quietly(os.kill, init, sig))
    _, status = os.waitpid(init, 0)
    reported = os.read(status_r, 32)
    _exit_as(int(reported) if reported else status)


def main(args: list[str]) -> None:
    if args == ["--probe"]:
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET), "unshare")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        return
    spec, argv = parse(args)
    _die_with_parent()
    if os.getppid() != int(spec["--parent"]):  # the spawning process died before the prctl
        os._exit(137)
    try:
        if spec["--mode"] == "pg":
            _exec(spec, argv)
        _outer(spec, argv)
    except OSError as exc:
        os.write(2, f"sandbox: {exc}\n".encode())
        os._exit(75)  # runner.INFRA_EXIT: the sandbox failed, not the command


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except OSError as exc:
        os.write(2, f"sandbox: {exc}\n".encode())
        sys.exit(1)
