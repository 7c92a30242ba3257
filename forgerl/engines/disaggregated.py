"""Prefill/decode disaggregation for the local engine: a prefill process and a decode process
behind one `RolloutEngine` (Forge §3.3's PD disaggregation, on CPU processes).

Data flow: `DisaggregatedEngine.stream` (caller's event loop) sends the request to the prefill
process, which runs one forward over prompt[:-1] (reusing its own prefix cache for shared
prefixes) and hands the request, that KV (one tensor in shared memory: torch's multiprocessing
pickler sends a file descriptor, not the bytes) and the weight version that built it to the
decode process through a pipe. The decode process offers the KV to its `LocalEngine`'s prefix
cache (`LocalEngine.insert_prefix`) and streams the request there: the cache then holds the
whole prompt but its last token, so the row joins the next decode step without a prefill
forward (batcher.py `_prefill_wave`), and that step computes the first token's logits. Each
TokenEvent and the GenerateOutput come back to the caller through the decode pipe; a reader
thread hands them to the caller's asyncio queue.

Why prompt[:-1] and not the whole prompt plus the first token's logits: the decode engine then
samples every token itself, the first one included, with its own sampler (seeded generator,
penalties over the prompt) and stamps it with its own weight version, exactly the path of a
prefix-cache hit in a single LocalEngine; the hand-off carries no logits or RNG state. The cost
is one more token in a decode step that runs anyway. Completions equal a single LocalEngine's
(greedy and seeded ids; logprobs up to float rounding: the prompt's KV comes from another
forward shape).

Weight updates (full and delta) go to both processes; `weight_version` moves when both applied
it. A hand-off built under another version than the decode engine's is dropped (the request
prefills in the decode engine instead), and an update clears both prefix caches, so no KV
built by old weights is attended under new ones. A worker process that dies (killed, crashed)
fails every in-flight request and every later call with a RuntimeError naming it.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp  # registers the shared-memory pickling of tensors
from transformers import PreTrainedModel

from forgerl.engines.base import TokenEvent
from forgerl.engines.local import LocalEngine
from forgerl.engines.local.kernels import ENGINE_SDPA
from forgerl.engines.local.kv_batch import _KVCache
from forgerl.engines.local.prefix_cache import KV, PrefixCache
from forgerl.engines.worker import push
from forgerl.models import router_modules
from forgerl.types import GenerateOutput, SamplingParams
from forgerl.weights import WeightDelta, apply_delta, pack, unpack

START_TIMEOUT_S = 300.0  # a worker that is not ready by then fails the constructor
HANDOFF_STATS = {"handoffs": 0, "handoff_tokens": 0, "handoff_bytes": 0, "handoff_seconds": 0.0,
                 "prefill_process_seconds": 0.0}  # the decode process's counters


class DisaggregatedEngine:
    """A `RolloutEngine` whose prefills run in one process and decode steps in another.

    model: a causal LM (copied into both processes). max_model_len, max_batch_size,
    prefix_cache_tokens, dtype, packed_weights: the decode process's `LocalEngine` settings
    (prefix_cache_tokens >= max_model_len: it must hold the hand-offs; the prefill process
    keeps a prefix cache of the same bound). threads: torch intra-op threads of each process.
    stats: the decode engine's stats (as LocalEngine's), plus "handoffs" (requests that came
    with KV), "handoff_tokens", "handoff_bytes", "handoff_seconds" (from the prefill process's
    send to the KV's arrival in the decode process: into shared memory, the pipe, mapping it,
    copying it out) and "prefill_process_seconds" (the prefill forwards).
    Raises ValueError for bad settings, RuntimeError when a worker does not start.
    """

    _closed_message = "DisaggregatedEngine is closed"

    def __init__(self, model: PreTrainedModel, max_model_len: int = 2048,
                 max_batch_size: int = 16, prefix_cache_tokens: int = 32768,
                 dtype: torch.dtype | None = None, packed_weights: bool = False,
                 threads: int = 1) -> None:
        if prefix_cache_tokens < max_model_len or threads < 1:
            raise ValueError(f"prefix_cache_tokens ({prefix_cache_tokens}) must be >= "
                             f"max_model_len ({max_model_len}) and threads ({threads}) >= 1")
        if router_modules(model):  # a hand-off carries KV, not the prompt's routed experts
            raise ValueError("a disaggregated engine does not serve MoE models (R3 needs the "
                             "prompt's routes, which a hand-off does not carry)")
        self.max_model_len, self._version = max_model_len, 0
        self.vocab_size = model.get_input_embeddings().num_embeddings
        dtype = dtype or torch.float32
        self.weight_dtype, self.device = dtype, torch.device("cpu")
        self._params = {k: torch.empty(v.shape, device="meta") for k, v in
                        model.state_dict().items()}  # names and shapes, to check updates
        self._closed, self._dead = False, None
        self._live: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._acks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids, self._send_lock = itertools.count(), threading.Lock()
        self.stats: dict[str, Any] = dict(HANDOFF_STATS)
        ctx = mp.get_context("spawn")
        self._prefill, prefill_end = ctx.Pipe()
        self._decode, decode_end = ctx.Pipe()
        handoff_in, handoff_out = ctx.Pipe(duplex=False)
        model = copy.deepcopy(model).to(dtype)
        engine_kwargs = {"max_model_len": max_model_len, "max_batch_size": max_batch_size,
                         "prefix_cache_tokens": prefix_cache_tokens, "dtype": dtype,
                         "packed_weights": packed_weights, "device": "cpu"}
        self._procs = {
            "prefill": ctx.Process(target=_prefill_main, name="forgerl-prefill", daemon=True,
                                   args=(model, prefill_end, handoff_out, prefix_cache_tokens,
                                         threads)),
            "decode": ctx.Process(target=_decode_main, name="forgerl-decode", daemon=True,
                                  args=(model, decode_end, handoff_in, engine_kwargs, threads)),
        }
        for proc in self._procs.values():
            proc.start()
        for end in (prefill_end, decode_end, handoff_in, handoff_out):
            end.close()
        for name, conn in (("prefill", self._prefill), ("decode", self._decode)):
            if not conn.poll(START_TIMEOUT_S) or (msg := _recv_or_close(conn))[0] != "ready":
                self._kill()
                raise RuntimeError(f"DisaggregatedEngine: the {name} worker did not start "
                                   f"(exit code {self._procs[name].exitcode})")
            self.stats.update(*msg[1:])  # the decode engine's counters, all keys from the start
        self._reader = threading.Thread(target=self._read, name="forgerl-pd-reader", daemon=True)
        self._reader.start()

    # ---- RolloutEngine API (event-loop side) --------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The version new requests are stamped with; setting it (a run resumed at step k)
        tells both workers, as assigning LocalEngine.weight_version does."""
        return self._version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        for conn in (self._prefill, self._decode):
            self._send(conn, ("version", version))
        self._version = version

    def load(self) -> dict[str, int]:
        """{"running": requests in flight, "waiting": 0} (a gauge for the router)."""
        return {"running": len(self._live), "waiting": 0}

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """The last item of `stream(prompt_ids, params)`; see `RolloutEngine.generate`."""
        *_, out = [item async for item in self.stream(prompt_ids, params)]
        assert isinstance(out, GenerateOutput)
        return out

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """As `LocalEngine.stream` (same checks and errors); also RuntimeError when a worker
        process died. Closing the iterator early or cancelling its consumer aborts the request
        in the decode process (or before it gets there)."""
        self._check_alive()
        LocalEngine._check_request(self, prompt_ids, params)  # type: ignore[arg-type]
        rid, events = next(self._ids), asyncio.Queue()
        self._live[rid] = (asyncio.get_running_loop(), events)
        done = False
        try:
            self._send(self._prefill, ("request", rid, list(prompt_ids), params))
            while True:
                item = await events.get()
                if isinstance(item, Exception):
                    done = True
                    raise item
                done = isinstance(item, GenerateOutput)
                yield item
                if done:
                    return
        finally:
            self._live.pop(rid, None)
            if not done and self._dead is None and not self._closed:
                self._send(self._decode, ("cancel", rid), quiet=True)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` in both processes (one packed copy in shared memory) and publish
        `version` once both applied it; raises ValueError (unknown names, shapes), what a
        worker raised, or RuntimeError (closed, a worker died)."""
        LocalEngine._check_state_dict(self, state_dict)  # type: ignore[arg-type]
        buffer, specs = pack({k: v.detach().cpu() for k, v in state_dict.items()},
                             self.weight_dtype)
        await self._broadcast("update", (buffer, specs), version)

    async def apply_delta(self, delta: WeightDelta, version: int) -> None:
        """Apply a weight-sync delta in both processes, then publish `version`; raises
        `forgerl.weights.DeltaMismatch` from a worker whose weights are not the delta's base
        (the weight sync then sends a full update to both)."""
        await self._broadcast("delta", delta, version)

    async def close(self) -> None:
        """Stop both workers; in-flight requests end with "abort". Idempotent."""
        if not self._closed:
            self._closed = True
            for conn in (self._prefill, self._decode):
                self._send(conn, ("close",), quiet=True)
        await asyncio.to_thread(self._join)

    # ---- caller side ------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError(self._closed_message)
        if self._dead is not None:
            raise RuntimeError(self._dead)

    async def _broadcast(self, kind: str, payload: object, version: int) -> None:
        """Send a weight update to both workers and wait for both acks; raise the first error."""
        self._check_alive()
        loop, futures = asyncio.get_running_loop(), []
        for conn in (self._prefill, self._decode):
            seq = next(self._ids)
            futures.append(loop.create_future())
            self._acks[seq] = (loop, futures[-1])
            self._send(conn, (kind, seq, payload, version))
        results = await asyncio.gather(*futures, return_exceptions=True)
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]
        self._version = version

    def _send(self, conn: Connection, msg: tuple, quiet: bool = False) -> None:
        try:
            with self._send_lock:  # callers on several threads must not interleave messages
                conn.send(msg)
        except (OSError, ValueError):  # the worker is gone: the reader fails its requests
            if not quiet:
                raise RuntimeError(self._dead or "DisaggregatedEngine: a worker is gone") from None

    def _read(self) -> None:
        """Reader thread: route each worker message to its caller. When a worker dies, fail
        every request and pending update (never a hang); after close(), end at the decode
        process's end of output (its "abort" outputs come first)."""
        conns = (self._prefill, self._decode)
        waits = [*conns, *(p.sentinel for p in self._procs.values())]
        while True:
            for ready in wait(waits):
                try:
                    msg = ready.recv() if ready in conns else None
                except (EOFError, OSError):
                    msg = None
                if msg is not None:
                    self._route(msg)
                elif not self._closed or ready is self._decode:
                    return self._fail_all()
                else:  # closing: wait for the decode process's last outputs
                    waits = [self._decode]

    def _route(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "event" and (entry := self._live.get(msg[1])) is not None:
            push(*entry, msg[2])
        elif kind == "ack" and (ack := self._acks.pop(msg[1], None)) is not None:
            loop, future = ack
            loop.call_soon_threadsafe(_settle, future, msg[2])
        elif kind == "stats":
            self.stats.update(msg[1])

    def _fail_all(self) -> None:
        """End every request: "abort" after close(), else a RuntimeError naming the dead worker
        (the other one is killed)."""
        item: Exception | GenerateOutput = GenerateOutput([], [], [], "abort")
        if not self._closed:
            for proc in self._procs.values():
                proc.join(1)
            name, proc = next(((n, p) for n, p in self._procs.items()
                               if p.exitcode not in (None, 0)), next(iter(self._procs.items())))
            self._dead = (f"DisaggregatedEngine: the {name} worker process (pid {proc.pid}) "
                          f"died, exit code {proc.exitcode}")
            item = RuntimeError(self._dead)
            self._kill()
        for loop, events in list(self._live.values()):
            push(loop, events, item)
        error = RuntimeError(self._dead or self._closed_message)
        for loop, future in list(self._acks.values()):
            loop.call_soon_threadsafe(_settle, future, error)
        self._acks.clear()

    def _join(self) -> None:
        for proc in self._procs.values():
            proc.join(30)
        self._kill()
        if hasattr(self, "_reader"):
            self._reader.join(30)

    def _kill(self) -> None:
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


# ---- the prefill process --------------------------------------------------------------------


def prefill_kv(model: torch.nn.Module, ids: tuple[int, ...], cache: PrefixCache) -> torch.Tensor:
    """KV of `ids` from one forward over what `cache` does not hold, inserted into `cache`:
    a tensor (layers, 2, kv_heads, len(ids), head_dim) (keys at [:, 0], values at [:, 1])."""
    n, past = cache.lookup(ids)
    kv_cache = _KVCache([(k[None], v[None]) for k, v in past] if past else None)
    positions = torch.arange(n, len(ids))[None]
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[n:]]), position_ids=positions, cache=kv_cache,
              use_cache=True, logits_to_keep=1)
    packed = torch.stack([torch.stack([layer.keys[0], layer.values[0]])
                          for layer in kv_cache.layers])
    cache.insert(ids, unpack_kv(packed))
    return packed


def unpack_kv(packed: torch.Tensor) -> KV:
    """Per layer (keys, values), each (kv_heads, L, head_dim), viewing `packed` (no copy)."""
    return [(layer[0], layer[1]) for layer in packed]


def _prefill_main(model: torch.nn.Module, conn: Connection, handoff: Connection,
                  cache_tokens: int, threads: int) -> None:
    """The prefill process: prefill requests in arrival order, hand each to the decode process
    with its KV; apply weight updates between two requests."""
    torch.set_num_threads(threads)
    model = model.eval()
    if model.config._attn_implementation == "sdpa":
        model.config._attn_implementation = ENGINE_SDPA
    params, version, cache = model.state_dict(), 0, PrefixCache(cache_tokens)
    inbox: queue.SimpleQueue = queue.SimpleQueue()  # drained at once: a caller never blocks
    threading.Thread(target=_pump, args=(conn, inbox.put), daemon=True).start()
    conn.send(("ready",))
    while (msg := inbox.get())[0] != "close":
        if msg[0] == "request":
            _, rid, prompt, sampling = msg
            start = time.perf_counter()
            try:
                kv = prefill_kv(model, tuple(prompt[:-1]), cache) if len(prompt) > 1 else None
            except Exception as exc:  # a failed forward fails this request only
                handoff.send(("error", rid, exc))
                continue
            now = time.perf_counter()
            kv = kv.clone() if kv is not None else None  # the cache's copy keeps no shm fd
            handoff.send(("handoff", rid, prompt, sampling, kv, version, now - start, now))
        elif msg[0] == "version":
            version = msg[1]
        else:
            version = _apply(msg, params, version, cache, conn)


def _apply(msg: tuple, params: dict, version: int, cache: PrefixCache, conn: Connection) -> int:
    """Apply a weight update message in the prefill process; ack it; the new version."""
    kind, seq, payload, new_version = msg
    try:
        if kind == "delta":
            apply_delta(params, payload, version)
        else:
            with torch.no_grad():
                for name, value in unpack(*payload).items():
                    params[name].copy_(value)
    except Exception as exc:
        conn.send(("ack", seq, exc))
        return version
    cache.clear()
    conn.send(("ack", seq, None))
    return new_version


def _recv_or_close(conn: Connection) -> tuple:
    try:
        return conn.recv()
    except (EOFError, OSError):  # the caller is gone
        return ("close",)


# ---- the decode process ---------------------------------------------------------------------


def _decode_main(model: torch.nn.Module, conn: Connection, handoff: Connection,
                 engine_kwargs: dict, threads: int) -> None:
    torch.set_num_threads(threads)
    asyncio.run(_decode_serve(LocalEngine(model, **engine_kwargs), conn, handoff))


async def _decode_serve(engine: LocalEngine, conn: Connection, handoff: Connection) -> None:
    """The decode process's loop: requests with their KV from the prefill process, cancels and
    weight updates from the caller; events back to the caller."""
    loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
    for source in (conn, handoff):
        put = functools.partial(loop.call_soon_threadsafe, inbox.put_nowait)
        threading.Thread(target=_pump, args=(source, put), daemon=True).start()
    tasks: dict[int, asyncio.Task] = {}
    cancelled: set[int] = set()
    stats = dict(HANDOFF_STATS)
    conn.send(("ready", stats | engine.stats))
    while (msg := await inbox.get())[0] != "close":
        kind, rid = msg[0], msg[1]
        if kind == "cancel":
            if (task := tasks.pop(rid, None)) is not None:
                task.cancel()
            else:
                cancelled.add(rid)
        elif kind == "error":
            conn.send(("event", rid, msg[2]))
        elif kind == "version":
            engine.weight_version = rid
        elif kind == "handoff":
            if rid in cancelled:
                cancelled.discard(rid)
                continue
            _, _, prompt, sampling, kv, version, seconds, sent_at, *received_at = msg
            if kv is not None:
                stats["handoff_seconds"] += received_at[0] - sent_at
                stats["handoffs"] += 1
                stats["handoff_tokens"] += len(prompt) - 1
                stats["handoff_bytes"] += kv.nbytes
                stats["prefill_process_seconds"] += seconds
                engine.insert_prefix(prompt[:-1], unpack_kv(kv), version)
            tasks[rid] = asyncio.create_task(_relay(engine, rid, prompt, sampling, conn, tasks,
                                                             stats))
            conn.send(("stats", stats | engine.stats))
        else:  # a weight update: in order, before later messages
            await _decode_update(engine, msg, conn)
    await engine.close()
    await asyncio.gather(*tasks.values(), return_exceptions=True)


async def _decode_update(engine: LocalEngine, msg: tuple, conn: Connection) -> None:
    kind, seq, payload, version = msg
    try:
        if kind == "delta":
            await engine.apply_delta(payload, version)
        else:
            await engine.update_weights(unpack(*payload), version)
    except Exception as exc:
        conn.send(("ack", seq, exc))
    else:
        conn.send(("ack", seq, None))


async def _relay(engine: LocalEngine, rid: int, prompt: list[int], params: SamplingParams,
                 conn: Connection, tasks: dict, stats: dict) -> None:
    """Stream one request in the decode engine; send each item (or its error) to the caller,
    the stats before the closing GenerateOutput."""
    try:
        async for item in engine.stream(prompt, params):
            if isinstance(item, GenerateOutput):
                conn.send(("stats", stats | engine.stats))
            conn.send(("event", rid, item))
    except asyncio.CancelledError:
        pass
    except Exception as exc:
        conn.send(("event", rid, exc))
    finally:
        tasks.pop(rid, None)


def _pump(conn: Connection, put: Callable[[tuple], object]) -> None:
    """Thread: hand each message from `conn` to `put`, then ("close",) at EOF or on any error
    (the process then ends, and the caller's reader reports it)."""
    try:
        while (msg := _recv_or_close(conn))[0] != "close":
            if msg[0] == "handoff" and msg[4] is not None:  # its KV is copied out of shared
                # memory, which closes that segment's file descriptor (held while it lives)
                msg = (*msg[:4], msg[4].clone(), *msg[5:], time.perf_counter())
            put(msg)
    finally:
        put(("close",))
