"""Several rollout-engine instances behind one `RolloutEngine`: the router (issue 12; Forge §3.3).

`Router` implements the engine contract over N instances, so the gateway and the controller see
one engine. Per request it describes every instance as an `InstanceLoad` (routable or not,
requests in flight, decode tokens they still owe, prompt tokens it is estimated to hold, measured
token rates, load bound) and asks a policy, a pure function of those loads, for an index:

- `round_robin`: the next routable instance in turn.
- `affinity`: the instance holding the longest prefix of the prompt when it covers at least
  `AFFINITY_MIN_MATCH` of it (SGLang cache_aware's threshold), else the least loaded. Requests
  carry no session id; prefixes suffice: an agent's turn k + 1 prompt extends turn k's prompt +
  completion (session affinity), and the G rollouts of a task share their prompt (group
  affinity: the first one's prompt is recorded when it is sent, so the siblings sent right after
  follow it).
- `cost_aware` (Forge §3.3): the minimum of `estimated_seconds`, among instances below their
  load bound: the prefill of the prompt tokens the instance does not hold plus the decode time
  the request adds there, both with the delay they impose on the requests already running (a
  continuous-batching engine's step costs t(B) = a + b·B seconds for B rows, so a request
  queues behind nobody but slows every row it shares steps with). With a global KV pool
  (`kv_pool`), an instance's prefill may instead fetch the pooled prefix at the pool's measured
  transfer cost, whichever is cheaper.

What each instance holds is the router's own estimate, a `PrefixIndex` (a trie of chained
`BLOCK`-token block hashes, LRU-bounded per instance like the engines' prefix caches): a request's
prompt is recorded when it is sent, its prompt + completion when it finishes, and an instance's
record is dropped when it loads new weights (LocalEngine clears its cache then). The prefill
rate and the step-time line t(B) are measured from the requests (see `RouterState`).
`RouterState` (routing.py, with the policies and the prefix index) is this bookkeeping without
I/O, on a clock the caller passes, so benchmarks/router.py runs the same code in a simulation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from typing import Any

import torch

from forgerl.engines.base import RolloutEngine, TokenEvent
from forgerl.engines.blocks import BLOCK
from forgerl.engines.kv_pool import KVPool, SharedKVPool
from forgerl.gateway.routing import (
    POLICIES,
    Flight,
    RouterState,
    block_hashes,
    dfs_order,
)
from forgerl.types import GenerateOutput, SamplingParams
from forgerl.weights import DeltaEngine, DeltaMismatch, WeightDelta

log = logging.getLogger("forgerl")


class Router:
    """A RolloutEngine over N engine instances (same model, same weights), one per request.

    router: "cost_aware" | "affinity" | "round_robin" (module docstring). cache_tokens: each
    instance's prefix-cache size in tokens (bounds the router's record of it). load_bound: most
    requests in flight per instance under cost_aware (default: max_batch_size, so late requests
    wait in the router for a slot instead of in one engine's queue).

    Health: an instance whose stream fails before its first token with anything but ValueError
    (a closed or broken engine) is marked unhealthy and the request goes to another one (nothing
    was sampled, so nothing is recorded twice); a successful weight update on it makes it
    healthy again, and when none is left healthy all are tried again.

    Weights: `update_weights` sends the state dict to every instance concurrently. Contract: on
    failure the old weights and version stay. The router cannot undo an instance's update (it
    holds no copy of the old weights), so when some healthy instance fails, it raises
    RuntimeError naming them, keeps weight_version, and routes only to instances still at that
    version; the instances that did take the new weights are held back (requests already on them
    go on, their tokens stamped with the new version, which produced them) until an update
    succeeds on all. New requests thus always run on weights of the router's weight_version.
    Unhealthy instances are sent the update too but their failure does not fail it.
    Deltas (`apply_delta`, issue 13): the same delta goes to every instance when all are
    DeltaEngines of one dtype (`weight_dtype` is then that dtype, else None and WeightSync sends
    full syncs); an instance that refuses it (weights.DeltaMismatch: it holds another
    version, e.g. a restarted actor) makes the whole delta refused, the others held back as
    above, and WeightSync's full sync that follows brings every instance to the new version.
    stats: the instances' own stats summed by key, plus RouterState.stats.
    kv_pool: the global KV pool the instances share (engines/kv_pool.py; they need a
    `kv_bytes_per_token`), or None: cost_aware then weighs fetching a pooled prefix at the pool's
    measured seconds per byte against recomputing it. Requests waiting for a slot are released
    in the DFS order of their prompts (`dfs_order`), so prefix-sharing requests go out together.
    """

    def __init__(self, instances: Sequence[RolloutEngine], router: str = "cost_aware",
                 cache_tokens: int = 32768, load_bound: int | None = None,
                 kv_pool: KVPool | None = None) -> None:
        if not instances or router not in POLICIES:
            raise ValueError(f"need >= 1 instance (got {len(instances)}) and router in "
                             f"{sorted(POLICIES)} (got {router!r})")
        self.instances = list(instances)
        bound = load_bound or getattr(self.instances[0], "max_batch_size", 16)
        self.kv_pool, self._token_bytes, pool_blocks = kv_pool, 0, 0
        if kv_pool is not None:  # the instances' KV bytes per token price the pool's blocks
            self._token_bytes = self.instances[0].kv_bytes_per_token  # type: ignore[attr-defined]
            pool_blocks = max(kv_pool.max_bytes // (BLOCK * self._token_bytes), 1)
        self.state = RouterState(len(instances), POLICIES[router], cache_tokens, bound,
                                 pool_blocks=pool_blocks)
        if kv_pool is not None:
            self._price_fetch()
        self.max_model_len = min(e.max_model_len for e in self.instances)
        self.weight_version = self.instances[0].weight_version
        self._waiters: list[tuple[list[int], asyncio.Event]] = []

    @property
    def weight_version(self) -> int:
        """The version every request routed now is served by (setting it sets every instance's)."""
        return self.state.version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        for e in self.instances:
            e.weight_version = version
        self.state.version, self.state.versions = version, [version] * len(self.instances)

    @property
    def stats(self) -> dict[str, int | float]:
        """Summed instance stats and per-instance router counters (flat, numeric)."""
        out: dict[str, int | float] = {}
        for e in self.instances:
            for k, v in getattr(e, "stats", {}).items():
                if isinstance(v, int | float):
                    out[k] = out.get(k, 0) + v
        return out | self.state.stats()

    def load(self) -> dict[str, int]:
        """The instances' `load()` summed ({} when none has one)."""
        out: dict[str, int] = {}
        for e in self.instances:
            for k, v in (e.load() if callable(getattr(e, "load", None)) else {}).items():
                out[k] = out.get(k, 0) + v
        return out

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """The last item of `stream(prompt_ids, params)` (RolloutEngine.generate)."""
        *_, out = [item async for item in self.stream(prompt_ids, params)]
        assert isinstance(out, GenerateOutput)
        return out

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """RolloutEngine.stream on the instance the policy picks (waiting while cost_aware finds
        every instance at its load bound). Closing or cancelling it aborts the request there.
        Raises RuntimeError when no instance can serve."""
        hashes, tried, s = block_hashes(prompt_ids), set(), self.state
        while True:
            if not any(s.routable(i) for i in range(s.n)):
                s.healthy = [True] * s.n  # nothing left: try every instance again
            i, cached = s.choose(prompt_ids, hashes, params.max_tokens)
            if i is not None and i in tried:
                raise RuntimeError(f"no engine instance could serve the request (tried {tried})")
            if i is None:
                if not any(s.routable(j) for j in range(s.n)):
                    raise RuntimeError("no healthy engine instance")
                freed = asyncio.Event()
                self._waiters.append((prompt_ids, freed))
                await freed.wait()
                continue
            now = time.perf_counter()
            flight = s.dispatch(i, prompt_ids, hashes, cached, params.max_tokens, now)
            inner = self.instances[i].stream(prompt_ids, params)
            try:
                item = await anext(inner)
            except BaseException as exc:  # a bad request, a cancelled caller, a failed instance
                self._land(flight, None)
                if isinstance(exc, ValueError) or not isinstance(exc, Exception):
                    raise
                log.warning("engine instance %d failed (%r): marked unhealthy", i, exc)
                s.healthy[i] = False
                tried.add(i)
                continue
            break
        out = None
        try:
            async with contextlib.aclosing(inner):
                while True:
                    if isinstance(item, TokenEvent):
                        s.token(flight, time.perf_counter())
                    yield item
                    if isinstance(item, GenerateOutput):
                        out = item
                        return
                    item = await anext(inner)
        finally:
            self._land(flight, out.completion_ids if out and out.finish_reason != "abort" else None)

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The instances' weight dtype when every one is a DeltaEngine holding that dtype (weight
        syncs cast to it and may send deltas), else None."""
        dtypes = {e.weight_dtype if isinstance(e, DeltaEngine) else None for e in self.instances}
        return dtypes.pop() if len(dtypes) == 1 else None

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights on every instance and publish `version`; see the class docstring for
        a failure on some instances (RuntimeError, old version kept)."""
        await self._publish([e.update_weights(state_dict, version) for e in self.instances],
                            version)

    async def apply_delta(self, delta: WeightDelta, version: int) -> None:
        """Apply a weight-sync delta on every instance and publish `version` (DeltaEngine);
        raises DeltaMismatch when an instance refuses it or takes no deltas, RuntimeError when
        one fails otherwise; the old version stays routed either way (class docstring)."""
        if self.weight_dtype is None:
            raise DeltaMismatch("not every engine instance takes deltas of one dtype")
        await self._publish([e.apply_delta(delta, version) for e in self.instances], version)

    async def _publish(self, updates: list[Coroutine[Any, Any, Any]], version: int) -> None:
        """Await one weight update per instance; publish `version` when every healthy instance
        took it (class docstring). Raises the first refusal (DeltaMismatch) as it is, or a
        RuntimeError naming the instances that failed."""
        s = self.state
        required = [s.healthy[i] for i in range(s.n)]
        results = await asyncio.gather(*updates, return_exceptions=True)
        failed = []
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                failed += [(i, result)] if required[i] or isinstance(result, DeltaMismatch) else []
                continue
            s.versions[i], s.healthy[i] = version, True
            s.index.forget(i)  # its cache was cleared with the old weights
            if s.pool is not None:  # and it advanced the pool to the new version
                s.pool.forget(0)
        self._wake()  # which instances are routable may have changed
        if not failed:
            s.version = version
            return
        if refused := [exc for _, exc in failed if isinstance(exc, DeltaMismatch)]:
            raise refused[0]
        raise RuntimeError(
            f"weight update to version {version} failed on instance(s) "
            f"{[i for i, _ in failed]}: {failed[0][1]!r}; weight_version stays {s.version}"
        ) from failed[0][1]

    async def close(self) -> None:
        """Close every instance, then a SharedKVPool (`SharedKVPool.close`); idempotent."""
        await asyncio.gather(*(e.close() for e in self.instances))
        if isinstance(self.kv_pool, SharedKVPool):
            self.kv_pool.close()

    def _land(self, flight: Flight, completion_ids: list[int] | None) -> None:
        self.state.land(flight, completion_ids, time.perf_counter())
        if self.kv_pool is not None:
            self._price_fetch()
        self._wake()

    def _price_fetch(self) -> None:
        """The pool's measured fetch cost per token, for the cost model."""
        assert self.kv_pool is not None
        self.state.fetch_s_per_token = self.kv_pool.seconds_per_byte() * self._token_bytes

    def _wake(self) -> None:
        """Wake the requests waiting for a slot in the DFS order of their prompts, so that a
        group's siblings and the turns sharing a prefix are routed one after another, each
        where (or while the pool holds what) the previous one just computed."""
        waiters, self._waiters = self._waiters, []
        for k in dfs_order([prompt for prompt, _ in waiters]):
            waiters[k][1].set()  # asyncio resumes the waiters in this order
