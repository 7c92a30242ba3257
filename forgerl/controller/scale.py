"""`forgerl gateway` with `[gateway] processes = N > 1`: N gateway workers behind one front.

Data flow: `serve_scaled` (this process: the supervisor and the front, gateway/front.py) --spawns-->
N workers (`worker`, reading RUN_DIR/gateway-I/worker.json), each `serve_one`
of a one-process config (its own engine, RUN_DIR/gateway-I for its request log and lock, the
run's pool and admin key) on a free loopback port --> the front on `[gateway] host:port`.

A worker that exits (or that the front finds refusing connections) is logged, taken out of
service, and each of its open sessions' trajectories is marked failed in the pool (error "gateway
worker I died: ..."); what it committed stays. It is not restarted: new sessions go to the live
workers. The supervisor stops every worker (SIGTERM) when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
from pathlib import Path

from forgerl.config import Config, ConfigError
from forgerl.controller.rundir import admin_key, open_run_dir
from forgerl.controller.startup import start_services
from forgerl.datapool import open_pool
from forgerl.gateway.front import Front


def worker_config(config: Config, run_dir: Path, index: int) -> Config:
    """Worker `index`'s config: one process on a free loopback port, RUN_DIR/gateway-I, the
    run's pool."""
    gc = config.gateway.model_copy(update={"processes": 1, "host": "127.0.0.1", "port": 0})
    pool = config.datapool if config.datapool.url else config.datapool.model_copy(
        update={"path": str(Path(config.datapool.location(run_dir)).resolve())})
    return config.model_copy(update={"run_dir": str(run_dir / f"gateway-{index}"),
                                     "gateway": gc, "datapool": pool})


async def _spawn(config: Config, run_dir: Path, index: int, key: str
                 ) -> tuple[asyncio.subprocess.Process, int]:
    """Start worker `index`; (its process, its port) once it listens. Raises ConfigError when
    it exits first (its own error is on stderr)."""
    wdir = run_dir / f"gateway-{index}"
    wdir.mkdir(exist_ok=True)
    if config.gateway.admin_key is None:  # the run's generated key, shared by every worker
        fd = os.open(wdir / "admin_key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
    spec = wdir / "worker.json"
    fd = os.open(spec, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold the key
    with os.fdopen(fd, "w") as f:
        json.dump(worker_config(config, run_dir, index).model_dump(mode="json"), f)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from forgerl.controller.scale import worker; "
        "worker(sys.argv[1])", str(spec),
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    while line := (await proc.stdout.readline()).decode():
        if line.startswith("ForgeRL gateway at http://"):
            port = int(line.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
            return proc, port
    await proc.wait()
    raise ConfigError(f"gateway.processes: worker {index} exited with code {proc.returncode} "
                      "before it listened (its error is above)")


async def serve_one(config: Config) -> None:
    """One gateway process (`[gateway] processes = 1`, and each worker) until cancelled."""
    async with start_services(config, training=False) as s:
        gc = config.gateway
        print(f"ForgeRL gateway at {s.server.base_url} (model {gc.model_name!r})"
              + ("" if gc.admin_key else f"; admin key in {s.run_dir / 'admin_key'}")
              + (f"; metrics at {s.server.base_url.removesuffix('/v1')}/metrics"
                 if gc.metrics else ""), flush=True)
        await asyncio.Event().wait()


async def serve_scaled(config: Config) -> None:
    """Serve `config.gateway.processes` workers behind one front on `[gateway] host:port`
    until cancelled; every worker is stopped (SIGTERM) then."""
    gc, n = config.gateway, config.gateway.processes
    run_dir, lock = open_run_dir(config)
    key = gc.admin_key or admin_key(run_dir)
    pool = open_pool(config.datapool.location(run_dir))
    started = await asyncio.gather(*(_spawn(config, run_dir, i, key) for i in range(n)),
                                   return_exceptions=True)
    procs = [s[0] for s in started if isinstance(s, tuple)]
    tasks: list[asyncio.Task[None]] = []

    def failed(index: int, trajectory_ids: list[str], reason: str) -> None:
        for tid in trajectory_ids:  # one that ended meanwhile keeps its status
            with contextlib.suppress(KeyError, ValueError):
                pool.finish_trajectory(tid, "failed", error=f"gateway worker {index} died: "
                                       f"{reason}")

    try:
        if errors := [e for e in started if isinstance(e, BaseException)]:
            raise errors[0]
        front = Front([("127.0.0.1", p) for _, p in started], failed,  # type: ignore[misc]
                      loopback_sessions=gc.admin_key is None)
        try:
            port = await front.start(gc.host, gc.port)
        except OSError as e:
            raise ConfigError(f"gateway.host / gateway.port: cannot listen on {gc.host}:"
                              f"{gc.port} ({e.strerror or e})") from e
        for i, proc in enumerate(procs):
            tasks.append(asyncio.create_task(_watch(front, i, proc)))
        print(f"ForgeRL gateway at http://{gc.host}:{port}/v1 (model {gc.model_name!r}; "
              f"{n} processes, pids {' '.join(str(p.pid) for p in procs)})"
              + ("" if gc.admin_key else f"; admin key in {run_dir / 'admin_key'}"), flush=True)
        await asyncio.Event().wait()
    finally:
        for task in tasks:
            task.cancel()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in procs:
            await proc.wait()
        pool.close()
        os.close(lock)


async def _watch(front: Front, index: int, proc: asyncio.subprocess.Process) -> None:
    """Relay worker `index`'s stdout; once it exits, take it out of service."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        sys.stdout.write(f"[gateway {index}] {line.decode(errors='replace')}")
    code = await proc.wait()
    front.mark_dead(index, f"pid {proc.pid} exited with code {code}")


def worker(spec: str) -> None:
    """A worker process: `serve_one` of the config in `spec` until SIGTERM (or its
    parent's death); SIGINT is the supervisor's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # Linux: end with the supervisor
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    config = Config.model_validate_json(Path(spec).read_text())

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve_one(config)

    asyncio.run(main())
