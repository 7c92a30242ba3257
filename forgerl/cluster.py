"""`[cluster] backend = "ray"`: engine instances and trainer ranks 1.. as Ray actors.

The controller, gateway and data pool stay on the driver and run the same loop as on one
machine; only the transport behind two interfaces changes:

- `RayEngine` is a RolloutEngine whose `stream` / `update_weights` / `apply_delta` are calls on
  an engine actor (a LocalEngine, or with `engine.type = "vllm"` a VllmEngine, built from the
  config inside it). Weights travel through the
  Ray object store: one `ray.put` per sync, however many engine actors `get` it; or, with
  `cluster.weight_transport = "broadcast"`, full syncs go as one torch.distributed broadcast
  from the driver to all engine actors (NCCL with GPUs, gloo on CPU; `_Broadcast`) and deltas
  still through the object store.
- `RayTrainerWorkers` has the interface of `data_parallel.TrainerWorkers` (send / collect /
  close): ranks 1..N-1 are actors that join rank 0 (the driver) over gloo at a TCP rendezvous
  on the driver's address, starting from the driver's weights and optimizer state.

All actors are placed in one placement group (`cluster.placement`: PACK, SPREAD or
STRICT_SPREAD over the nodes), each bundle with `engine_cpus` / `engine_gpus` or
`trainer_cpus` CPUs. A dead engine actor is restarted by Ray (`max_restarts`); the requests it
was serving raise RuntimeError (the gateway records them failed), and the restarted actor gets
the last synced weights again before it serves. A dead trainer worker makes the step raise
RuntimeError naming it (data_parallel.DataParallelTrainer), never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import socket
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from forgerl.config import Config
from forgerl.engines.base import TokenEvent
from forgerl.engines.local import LocalEngine
from forgerl.models import engine_dtype, load_policy
from forgerl.trainer.data_parallel import build_trainer, join_trainer_group
from forgerl.types import GenerateOutput, SamplingParams
from forgerl.weights import DeltaMismatch, pack, packed_nbytes, unique_tensors, unpack, weight_group


class _Engine:
    """Body of an engine actor: the config's engine (a LocalEngine, or a VllmEngine on the model
    folder; the trainer's weights come with the first `update_weights`); dtype: a LocalEngine's
    weights' torch dtype name (default: LocalEngine's)."""

    def __init__(self, config_dump: dict, dtype: str | None = None) -> None:
        config = Config.model_validate(config_dump)
        ec = config.engine
        if ec.type == "vllm":
            from forgerl.engines.vllm import VllmEngine  # lazy: optional extra (vllm)

            self.engine: Any = VllmEngine.from_config(config)
            return
        self.engine = LocalEngine(load_policy(config.model.path)[0], config.model.max_model_len,
                                  ec.max_batch_size, prefix_cache_tokens=ec.prefix_cache_tokens,
                                  dtype=engine_dtype(dtype or ec.dtype))

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[TokenEvent | GenerateOutput]:
        async for item in self.engine.stream(prompt_ids, params):
            yield item

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor],
                             version: int) -> dict[str, Any]:
        await self.engine.update_weights(state_dict, version)
        return dict(self.engine.stats)

    async def apply_delta(self, delta: Any, version: int) -> dict[str, Any]:
        if not hasattr(self.engine, "apply_delta"):  # vLLM: the sync falls back to full
            raise DeltaMismatch("this engine loads full weights only")
        await self.engine.apply_delta(delta, version)
        return dict(self.engine.stats)

    async def join(self, address: tuple[str, int], rank: int, world: int, epoch: int,
                   backend: str, timeout_s: float) -> None:
        """Become `rank` of the weight-broadcast group hosted at `address` (_Broadcast)."""
        store = torch.distributed.TCPStore(*address, world, False, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=timeout_s))
        self.group = await asyncio.to_thread(weight_group, store, rank, world, epoch, backend,
                                             timeout_s)

    async def receive(self, specs: list, version: int) -> dict[str, Any]:
        """Take one packed full sync from the group's broadcast, then `update_weights`."""
        buffer = torch.empty(packed_nbytes(specs), dtype=torch.uint8, device=self.engine.device)
        await asyncio.to_thread(lambda: self.group.broadcast(buffer, 0).wait())
        return await self.update_weights(unpack(buffer, specs), version)

    def info(self) -> tuple[str, int, str]:
        """(dtype name, pid, Ray node id)."""
        dtype = str(self.engine.weight_dtype).removeprefix("torch.")
        return dtype, os.getpid(), _ray().get_runtime_context().get_node_id()


_PUTS: dict[int, list] = {}  # id(state dict) → [ObjectRef, engines still reading it]


class _Broadcast:
    """Full syncs to every engine actor of the run as one torch.distributed broadcast of a
    `pack`ed buffer in the engines' dtype (`[cluster] weight_transport = "broadcast"`): the
    driver is rank 0 of a group of its own (NCCL when the engines have GPUs, else gloo), engine
    i is rank i + 1. Every engine must be updated with the same state dict at once (Router does)
    so that one broadcast serves all: the last one to ask sends it. A failure (a member died)
    fails the sync for all and forms the group again (a new epoch) for the next one. The last
    packed buffer is kept, on the trainer's device, for restoring a restarted actor. Building
    one sets each of `engines`' `broadcast` to it."""

    def __init__(self, engines: list[RayEngine], backend: str, timeout_s: float = 120.0) -> None:
        self.engines, self.backend, self.timeout_s = engines, backend, timeout_s
        for e in engines:
            e.broadcast = self
        self.group: Any = None
        self.store: Any = None
        self.epoch = 0
        self.waiting: dict[int, list] = {}  # id(state dict) → [(engine, future)]
        self.sending: Any = None  # the task of the last broadcast

    async def update(self, engine: RayEngine, state_dict: Mapping[str, torch.Tensor],
                     version: int) -> tuple[dict, Mapping[str, torch.Tensor]]:
        """(engine's stats, the weights it now holds) once the broadcast reached every engine;
        raises what the actor raises, or RuntimeError (a member died, or not every engine was
        updated within timeout_s)."""
        entry = self.waiting.setdefault(id(state_dict), [])
        entry.append((engine, asyncio.get_running_loop().create_future()))
        if len(entry) == len(self.engines):
            del self.waiting[id(state_dict)]
            self.sending = asyncio.ensure_future(self._send(state_dict, version, entry))
        try:
            return await asyncio.wait_for(asyncio.shield(entry[-1][1]), self.timeout_s)
        except TimeoutError:
            self.waiting.pop(id(state_dict), None)
            raise RuntimeError(f"broadcast sync: only {len(entry)} of {len(self.engines)} "
                               f"engines were updated within {self.timeout_s:.0f} s") from None

    async def _send(self, state_dict: Mapping[str, torch.Tensor], version: int,
                    entry: list) -> None:
        """Pack, broadcast (forming the group first when a member was lost; once more after a
        failed broadcast), then each engine's own result to its future."""
        results: list = []
        try:
            buffer, specs = pack(state_dict, self.engines[0].weight_dtype)
            for attempt in (1, 2):
                try:
                    if self.group is None or any(e._rejoin for e in self.engines):
                        await self._form()
                    refs = [e.actor.receive.remote(specs, version) for e in self.engines]
                    await asyncio.to_thread(lambda: self.group.broadcast(buffer, 0).wait())
                    break
                except Exception:
                    self.group = None
                    if attempt == 2:
                        raise
            weights = unpack(buffer, specs)  # what every engine now holds (for restores)
            for e, ref in zip(self.engines, refs, strict=True):
                try:
                    with e._errors():
                        results.append((await ref, weights))
                except Exception as exc:
                    results.append(exc)
        except BaseException as exc:
            results = [RuntimeError(f"broadcast sync of version {version} failed: {exc}")] \
                * len(self.engines)
        by_engine = dict(zip(map(id, self.engines), results, strict=True))
        for engine, future in entry:
            result = by_engine[id(engine)]
            future.set_exception(result) if isinstance(result, BaseException) \
                else future.set_result(result)

    async def _form(self) -> None:
        """A new group of the driver and every engine actor (epoch + 1)."""
        host, world = _ray().util.get_node_ip_address(), len(self.engines) + 1
        if self.store is None:
            self.store = torch.distributed.TCPStore(
                host, 0, world, True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.timeout_s))
        self.group, self.epoch = None, self.epoch + 1
        for e in self.engines:
            e._rejoin = False
        address = (host, self.store.port)
        joins = [e.actor.join.remote(address, i + 1, world, self.epoch, self.backend,
                                     self.timeout_s) for i, e in enumerate(self.engines)]
        self.group = await asyncio.to_thread(weight_group, self.store, 0, world, self.epoch,
                                             self.backend, self.timeout_s)
        await asyncio.gather(*joins)


class RayEngine:
    """A RolloutEngine over one engine actor (see the module docstring).

    weight_version: the version of the last update that succeeded (the actor stamps tokens).
    stats: the actor's LocalEngine stats as of the last weight update (one step stale).
    `stream` raises ValueError for a prompt + max_tokens over max_model_len (before any call),
    what the actor's engine raises for a bad request, and RuntimeError when the actor died (it
    is restarted; the next request first restores the last synced weights).
    """

    def __init__(self, actor: Any, max_model_len: int, max_batch_size: int) -> None:
        self.actor, self.max_model_len, self.max_batch_size = actor, max_model_len, max_batch_size
        self.weight_version, self.stats = 0, {}
        self._last: tuple[Any, int] | None = None  # (weights or ObjectRef, version), last full
        self._restore = self._rejoin = False  # actor died: restore weights, join a new group
        self.broadcast: _Broadcast | None = None  # set by RayCluster.engines
        dtype, self.pid, self.node_id = _ray().get(actor.info.remote())
        self.weight_dtype = getattr(torch, dtype)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """The last item of `stream` (RolloutEngine.generate)."""
        *_, out = [item async for item in self.stream(prompt_ids, params)]
        return out

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """RolloutEngine.stream on the actor; closing or cancelling it cancels the actor task,
        which aborts the request there."""
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds max_model_len {self.max_model_len}")
        if self._restore and self._last is not None:  # after a delta: the last full sync's
            await self._call(self.actor.update_weights, *self._last)
            self._restore, self.weight_version = False, self._last[1]
        gen, done = self.actor.stream.remote(prompt_ids, params), False
        try:
            with self._errors():
                async for ref in gen:
                    item = await ref
                    done = isinstance(item, GenerateOutput)
                    yield item
        finally:
            if not done:
                _ray().cancel(gen)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Publish `state_dict` as `version` on the actor, through one object-store copy shared
        by every RayEngine updated with the same dict concurrently (Router.update_weights), or
        through `broadcast`, which then waits for all of the run's engines to be updated.
        Raises what the actor's engine raises (ValueError for bad keys/shapes) or RuntimeError
        (actor died); the old version then stays."""
        if self.broadcast is not None:
            self.stats, weights = await self.broadcast.update(self, state_dict, version)
            self._last, self._restore, self.weight_version = (weights, version), False, version
            return
        ray, key = _ray(), id(state_dict)
        if key not in _PUTS:
            # tied names once: copies out of the object store no longer share storage
            _PUTS[key] = [ray.put(unique_tensors(state_dict)), 0]
        entry = _PUTS[key]
        entry[1] += 1
        try:
            self.stats = await self._call(self.actor.update_weights, entry[0], version)
            self._last, self._restore, self.weight_version = (entry[0], version), False, version
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del _PUTS[key]

    async def apply_delta(self, delta: Any, version: int) -> None:
        """`LocalEngine.apply_delta` on the actor (raises weights.DeltaMismatch there).
        A restarted actor then refuses deltas, and WeightSync falls back to a full sync."""
        self.stats = await self._call(self.actor.apply_delta, delta, version)
        self.weight_version = version

    async def close(self) -> None:
        """Kill the actor; idempotent."""
        _ray().kill(self.actor, no_restart=True)

    async def _call(self, method: Any, *args: Any) -> Any:
        with self._errors():
            return await method.remote(*args)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """A dead actor → RuntimeError (and a restore before the next request); the actor's
        own error → itself, without Ray's traceback (ValueError for a bad request)."""
        ray = _ray()
        try:
            yield
        except ray.exceptions.RayActorError as e:
            self._restore = self._rejoin = True
            raise RuntimeError(f"engine actor (pid {self.pid}) died: {e}") from None
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None


class _TrainerRank:
    """Body of a trainer-worker actor: rank `rank` of the data-parallel trainer."""

    def __init__(self, rank: int, init: str, config_dump: dict, timeout_s: float,
                 state: tuple[int, dict, dict]) -> None:
        config = Config.model_validate(config_dump)
        join_trainer_group(config, init, rank, timeout_s)
        torch.manual_seed(config.seed)
        self.trainer = build_trainer(config, load_policy(config.model.path)[0])
        self.trainer.step = state[0]
        self.trainer.model.load_state_dict(state[1])
        self.trainer.optimizer.load_state_dict(state[2])

    def train_step(self, message: list | str) -> None:
        self.trainer.serve(message)

    def pid(self) -> int:
        return os.getpid()


class RayCluster:
    """Connects to Ray (`cluster.address`: "local" starts one in this process, "auto" joins the
    running cluster, else "host:port") and reserves one placement group for the run's actors:
    `engine.instances` engine bundles and `trainer.workers - 1` trainer bundles. Raises
    RuntimeError when the placement group cannot be reserved within `timeout_s` seconds."""

    def __init__(self, config: Config, timeout_s: float = 120.0) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group  # lazy: optional extra (ray)

        cc, self.config = config.cluster, config
        self.started = not ray.is_initialized()
        if self.started:
            ray.init(address=None if cc.address == "local" else cc.address,
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
        engine = {"CPU": cc.engine_cpus} | ({"GPU": cc.engine_gpus} if cc.engine_gpus else {})
        bundles = [engine] * config.engine.instances
        trainer = {"CPU": cc.trainer_cpus} | ({"GPU": cc.trainer_gpus} if cc.trainer_gpus else {})
        bundles += [trainer] * (config.trainer.workers - 1)
        self.group = placement_group(bundles, strategy=cc.placement)
        if not self.group.wait(timeout_s):
            raise RuntimeError(f"cluster: could not place {bundles} ({cc.placement}) on the Ray "
                               f"cluster within {timeout_s:.0f} s: {ray.cluster_resources()}")

    def _options(self, index: int, resources: dict) -> dict:
        # lazy: optional extra (ray)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=index), **resources}

    def engines(self) -> list[RayEngine]:
        """One RayEngine per `engine.instances`, each actor in its own bundle (sharing one
        _Broadcast with `cluster.weight_transport = "broadcast"`)."""
        ray, cc, ec = _ray(), self.config.cluster, self.config.engine
        actor = ray.remote(max_restarts=cc.max_restarts)(_Engine)
        dump = self.config.model_dump()
        engines = [RayEngine(actor.options(**self._options(i, {"num_cpus": cc.engine_cpus,
                                                             "num_gpus": cc.engine_gpus}),
                                        ).remote(dump), self.config.model.max_model_len,
                          ec.max_batch_size) for i in range(ec.instances)]
        if cc.weight_transport == "broadcast":
            cuda = cc.engine_gpus > 0 and torch.cuda.is_available()
            _Broadcast(engines, "nccl" if cuda else "gloo")
        return engines

    def trainer_workers(self, trainer: Any, timeout_s: float = 300.0) -> RayTrainerWorkers:
        """Ranks 1.. as actors, rank 0 = this process (`trainer`'s weights and optimizer)."""
        return RayTrainerWorkers(self, trainer, timeout_s)

    def close(self) -> None:
        """Remove the placement group (its actors go with it); shut Ray down if we started it."""
        ray = _ray()
        from ray.util.placement_group import remove_placement_group  # lazy: optional extra

        remove_placement_group(self.group)
        if self.started:
            ray.shutdown()


class RayTrainerWorkers:
    """`TrainerWorkers` (send / collect / close) with ranks 1.. as Ray actors; `pids` are their
    process ids. The rendezvous is tcp://driver-address:free-port."""

    def __init__(self, cluster: RayCluster, trainer: Any, timeout_s: float) -> None:
        ray, config = _ray(), cluster.config
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            init = f"tcp://{host}:{s.getsockname()[1]}"
        state = ray.put((trainer.step, trainer.model.state_dict(),
                         trainer.optimizer.state_dict()))
        actor = ray.remote(max_restarts=0)(_TrainerRank)
        cc, first = config.cluster, config.engine.instances
        resources = {"num_cpus": cc.trainer_cpus, "num_gpus": cc.trainer_gpus}
        self.actors = [actor.options(**cluster._options(first + rank - 1, resources))
                       .remote(rank, init, config.model_dump(), timeout_s, state)
                       for rank in range(1, config.trainer.workers)]
        join_trainer_group(config, init, 0, timeout_s)
        self.pids = ray.get([a.pid.remote() for a in self.actors])
        self.pending: list = []

    def send(self, message: list | str) -> None:
        """Start one `DataParallelTrainer.serve` on every worker (one object-store copy of a
        step's groups)."""
        ray = _ray()
        ref = ray.put(message)
        self.pending = [a.train_step.remote(ref) for a in self.actors]

    def collect(self, cause: BaseException | None) -> None:
        """Wait for every worker's step; RuntimeError naming the first failed worker (or
        `cause`)."""
        ray, pending, self.pending = _ray(), self.pending, []
        for rank, ref in enumerate(pending, start=1):
            try:
                ray.get(ref, timeout=None if cause is None else 5.0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(f"trainer worker {rank} has exited: {e}") from cause
            except ray.exceptions.RayTaskError as e:
                raise RuntimeError(f"trainer worker {rank}: {e.cause!r}") from cause
        if cause is not None:
            raise RuntimeError(f"data-parallel trainer step failed: {cause}") from cause

    def close(self) -> None:
        """Kill the workers and leave the process group."""
        for a in self.actors:
            _ray().kill(a)
        if dist.is_initialized():
            dist.destroy_process_group()


def _ray() -> Any:
    try:
        import ray  # lazy: optional extra (ray)
    except ImportError:
        raise RuntimeError("cluster.backend = \"ray\" needs Ray: pip install 'forgerl[ray]'") \
            from None
    return ray
