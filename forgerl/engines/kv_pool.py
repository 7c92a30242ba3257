"""A global prefix-KV pool (Forge §3.3's L3 cache): KV blocks shared by engine instances.

Data flow: a LocalEngine publishes its rows' KV (`publish`: after a prefill, and when a row
finishes, beside its own prefix cache) as BLOCK-token blocks keyed by the chained block hashes
of forgerl/engines/blocks.py; a prefill whose local prefix-cache hit is shorter than the pooled
prefix fetches the blocks (`fetch`) and prefills only the rest. The router's cost model
(gateway/routing.py) weighs that fetch, at the pool's measured `seconds_per_byte`, against
recomputing the prefix.

A block is one tensor (layers, 2, kv_heads, BLOCK, head_dim) of the KV dtype. Backends: `KVPool`
holds them in this process (engines in one process share the object; thread-safe);
`SharedKVPool` is a client of `serve`, a process holding a KVPool of raw bytes behind a unix
socket, so engines in several processes share one pool. Both are LRU-bounded in bytes (a
chain's root is touched last, so eviction cuts prefixes from their leaves).

Versions: every call names the weight version that built (or will read) the KV. `advance(v)`
(an engine's weight update), or a put of a newer version, drops every block of another
version; a put of an older version is ignored and a get naming a version other than the pool's
is a miss, so no KV crosses weight versions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import torch

from forgerl.engines.blocks import BLOCK, block_hashes

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (H, L, D)
PROBE_BYTES = 1 << 22  # the bandwidth probe's payload
log = logging.getLogger(__name__)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return len(value[2])  # SharedKVPool's (dtype, shape, bytes)


class KVPool:
    """KV blocks keyed by chained block hash, of one weight version, LRU-bounded in bytes.

    max_bytes: the bound (a block larger than it is not kept). stats: "blocks", "bytes",
    "evicted_blocks", and "fetch_bytes" / "fetch_seconds" of the engines' fetches (copies
    included), from which `seconds_per_byte` is measured.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 (got {max_bytes})")
        self.max_bytes, self.version = max_bytes, 0
        self.blocks: OrderedDict[int, Any] = OrderedDict()
        self.stats: dict[str, int | float] = {"blocks": 0, "bytes": 0, "evicted_blocks": 0,
                                              "fetch_bytes": 0, "fetch_seconds": 0.0}
        self._lock = threading.Lock()
        self._probe: float | None = None

    def advance(self, version: int) -> None:
        """Serve `version` from now on: every block of another version is dropped."""
        with self._lock:
            self._advance(version)

    def _advance(self, version: int) -> None:
        if version != self.version:
            self.version = version
            self.blocks.clear()
            self.stats["blocks"] = self.stats["bytes"] = 0

    def held(self, version: int, hashes: Sequence[int]) -> list[bool]:
        """Per hash, whether its block is held for `version` (all False for another one)."""
        with self._lock:
            return [version == self.version and h in self.blocks for h in hashes]

    def put(self, version: int, hashes: Sequence[int], blocks: Sequence[Any]) -> None:
        """Keep blocks[k] under hashes[k] (None: only touch a held one); evict LRU blocks to fit.
        A newer version than the pool's advances it first; an older one is ignored."""
        with self._lock:
            if version > self.version:
                self._advance(version)
            if version != self.version:
                return
            for h, block in zip(reversed(hashes), reversed(blocks), strict=True):
                if h in self.blocks:
                    self.blocks.move_to_end(h)
                elif block is not None and _nbytes(block) <= self.max_bytes:
                    self.blocks[h] = block
                    self.stats["blocks"] += 1
                    self.stats["bytes"] += _nbytes(block)
            while self.stats["bytes"] > self.max_bytes:
                _, old = self.blocks.popitem(last=False)
                self.stats["blocks"] -= 1
                self.stats["bytes"] -= _nbytes(old)
                self.stats["evicted_blocks"] += 1

    def get(self, version: int, hashes: Sequence[int]) -> list[Any]:
        """The blocks of the longest held leading run of `hashes` (marked recently used)."""
        with self._lock:
            if version != self.version:
                return []
            out = []
            for h in hashes:
                if h not in self.blocks:
                    break
                out.append(self.blocks[h])
            for h in reversed(hashes[: len(out)]):
                self.blocks.move_to_end(h)
            return out

    def record_fetch(self, nbytes: int, seconds: float) -> None:
        """Count one engine fetch (its bytes and wall seconds, copies included)."""
        with self._lock:
            self.stats["fetch_bytes"] += nbytes
            self.stats["fetch_seconds"] += seconds

    def seconds_per_byte(self) -> float:
        """Measured fetch cost: seconds per byte over the fetches so far (once they moved
        PROBE_BYTES), else a one-time probe: a copy of PROBE_BYTES in this process, their round
        trip through the socket for a SharedKVPool."""
        if self.stats["fetch_bytes"] >= PROBE_BYTES:
            return self.stats["fetch_seconds"] / self.stats["fetch_bytes"]
        if self._probe is None:
            block = torch.ones(PROBE_BYTES // 4)
            start = time.perf_counter()
            self._fetch_probe(block)
            self._probe = (time.perf_counter() - start) / PROBE_BYTES
        return self._probe

    def _fetch_probe(self, block: torch.Tensor) -> None:
        block.clone()  # a fetch in this process is a copy

    def echo(self, value: Any) -> Any:
        """`value` (the shared pool's probe: a round trip through its socket)."""
        return value


class SharedKVPool(KVPool):
    """A client of the pool process `serve` at unix socket `path` (thread-safe: one connection
    behind a lock); blocks travel as raw bytes. `SharedKVPool.start` runs that process."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(1)
        self.path, self.process = str(path), None
        self._conn: Connection = Client(self.path, family="AF_UNIX")
        self._call_lock = threading.Lock()
        self.gone = False  # the pool process stopped answering (see _call)

    @classmethod
    def start(cls, path: str | Path, max_bytes: int, timeout: float = 30.0) -> SharedKVPool:
        """Start `serve(path, max_bytes, owner=this process)` in a new Python process and
        connect to it; the pool process ends when this process does, even by SIGKILL."""
        proc = subprocess.Popen([sys.executable, "-m", "forgerl.engines.kv_pool", str(path),
                                 str(max_bytes), str(os.getpid())])
        deadline = time.monotonic() + timeout
        while True:  # the socket file exists from bind(), before listen(): retry refusals
            try:
                pool = cls(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"the KV pool process did not start at {path}") from None
                time.sleep(0.02)
        pool.process = proc
        return pool

    def _fetch_probe(self, block: torch.Tensor) -> None:
        raw = self._call("echo", block.view(torch.uint8).numpy().tobytes(), lost=bytes(4))
        torch.frombuffer(bytearray(raw), dtype=torch.float32).clone()

    def _call(self, *msg: Any, lost: Any = None) -> Any:
        """Send `msg`, return the answer; once the pool process is gone (killed, crashed), warn
        once and answer `lost` from then on: an empty pool, so the engines go on recomputing
        (a raise here would fail every prefill and leave a weight update unsettled)."""
        with self._call_lock:
            if not self.gone:
                try:
                    self._conn.send(msg)
                    return self._conn.recv()
                except (OSError, EOFError) as exc:
                    self.gone = True
                    log.warning("the shared KV pool process at %s is gone (%r): going on "
                                "without the pool", self.path, exc)
            return lost

    def advance(self, version: int) -> None:
        self._call("advance", version)

    def held(self, version: int, hashes: Sequence[int]) -> list[bool]:
        return self._call("held", version, list(hashes), lost=[False] * len(hashes))

    def put(self, version: int, hashes: Sequence[int], blocks: Sequence[Any]) -> None:
        wire = [None if b is None else (str(b.dtype).removeprefix("torch."), tuple(b.shape),
                                        b.contiguous().view(torch.uint8).numpy().tobytes())
                for b in blocks]
        self._call("put", version, list(hashes), wire)

    def get(self, version: int, hashes: Sequence[int]) -> list[Any]:
        return [torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(shape)
                for dtype, shape, raw in self._call("get", version, list(hashes), lost=[])]

    @property
    def pool_stats(self) -> dict[str, int | float]:
        """The pool process's own stats (blocks, bytes, evicted_blocks); {} once it is gone."""
        return self._call("stats", lost={})

    def close(self) -> None:
        """Close the connection; stop the pool process when this client started it (idempotent)."""
        with contextlib.suppress(OSError):
            self._conn.close()
        if self.process is not None and self.process.poll() is None:  # started here: stop it
            self.process.terminate()
            self.process.wait(10)
            Path(self.path).unlink(missing_ok=True)


def serve(path: str, max_bytes: int, owner: int | None = None) -> None:
    """Serve a KVPool of raw-bytes blocks at unix socket `path` until killed (or, with `owner`,
    the pid of this process's parent, until that parent is gone: no orphan pool), a thread per
    client; messages are pickled (method, *args) tuples, answers the method's result. Anyone who
    can open the socket is trusted: put it in a private folder (SharedKVPool.start's caller)."""
    pool, listener = KVPool(max_bytes), Listener(path, family="AF_UNIX")
    if owner is not None:
        threading.Thread(target=_exit_with, args=(owner, path), daemon=True).start()

    def client(conn: Connection) -> None:
        with conn:
            while True:
                try:
                    method, *args = conn.recv()
                except (EOFError, OSError):
                    return
                conn.send(pool.stats if method == "stats" else getattr(pool, method)(*args))

    while True:
        conn = listener.accept()
        threading.Thread(target=client, args=(conn,), daemon=True).start()


def _exit_with(owner: int, path: str) -> None:
    """End this process once its parent `owner` is gone (it was re-parented)."""
    while os.getppid() == owner:
        time.sleep(0.5)
    Path(path).unlink(missing_ok=True)
    os._exit(0)


def publish(pool: KVPool, version: int, ids: Sequence[int], kv: KV) -> None:
    """Put the full BLOCK-token blocks of one sequence's KV (`ids`, its len(ids) columns)."""
    hashes = block_hashes(ids[: kv[0][0].shape[1]])
    held = pool.held(version, hashes)
    if all(held):
        pool.put(version, hashes, [None] * len(hashes))
        return
    blocks = [None if h else torch.stack([torch.stack((k[:, s : s + BLOCK], v[:, s : s + BLOCK]))
                                          for k, v in kv])
              for h, s in zip(held, range(0, len(hashes) * BLOCK, BLOCK), strict=True)]
    pool.put(version, hashes, blocks)


def fetch(pool: KVPool, version: int, ids: Sequence[int], have: int) -> tuple[int, KV | None]:
    """(n, KV of ids[:n]) from the pool when it holds a longer prefix than `have` tokens (n
    capped at len(ids) - 1: one token is left to prefill), else (0, None)."""
    start = time.perf_counter()
    hashes = block_hashes(ids)
    k = have // BLOCK  # the first block not wholly held locally
    if k >= len(hashes) or not pool.held(version, hashes[k : k + 1])[0]:
        return 0, None
    blocks = pool.get(version, hashes)
    n = min(len(blocks) * BLOCK, len(ids) - 1)
    if n <= have:
        return 0, None
    whole = torch.cat(blocks, dim=3)[:, :, :, :n]  # (layers, 2, H, n, D)
    pool.record_fetch(sum(_nbytes(b) for b in blocks), time.perf_counter() - start)
    return n, [(layer[0], layer[1]) for layer in whole]


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
