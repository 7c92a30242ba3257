"""Building and starting the services of a run (`start_services`) and stopping them again.

    task generation (fork server child) ─┐
    agent fork servers ──────────────────┤
    policy + renderer + demos ─► RUN_DIR lock ─► pool ─► trainer ─► resume ─► scheduler
                                         ─► engines (local | remote | vllm | Ray actors)
                                         ─► gateway (HTTP) ─► RUN_DIR/config.json ─► Services

Everything that can refuse the config (tasks, model, renderer, demonstrations, the lock, the
agent command) runs before anything of the run is written. torch and the engines are imported
in `_build`, not at module level: `cli.main` sets up glibc's malloc arenas first.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from forgerl.agents.reaper import Reaper
from forgerl.config import Config, ConfigError
from forgerl.controller.policies import build_policies, load_models
from forgerl.controller.rollouts import (
    Agent,
    agent_command,
    check_agent_command,
    preload_of,
    start_forkserver,
)
from forgerl.controller.rundir import (
    admin_key,
    claim_pool,
    open_run_dir,
    resume,
    save_config,
)
from forgerl.controller.services import Services
from forgerl.controller.tasks import make_task_sets
from forgerl.datapool import open_pool
from forgerl.metrics import MetricsLogger
from forgerl.rewards.scoring import submit
from forgerl.scheduler.policies import Scheduler
from forgerl.tasks.sources import build_environment
from forgerl.trainer.checkpoint import checkpoint_step, latest_checkpoint, load_drafter

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def start_services(config: Config, agent: Agent | None = None,
                         training: bool = True) -> AsyncIterator[Services]:
    """Build and start every service; resume from RUN_DIR/checkpoint when one exists.

    `training`: this process's controller owns the task indices >= 0 (`forgerl train`), so the
    gateway opens no HTTP session on them; False for `forgerl gateway`. The task generation
    and the command agents' fork servers start first, so their imports run beside this
    process's. Raises ConfigError (one line naming the field) for a config that cannot run.
    """
    sections = [d.tasks for d in config.domains] or [config.tasks]
    task_sets = (asyncio.wrap_future(submit(make_task_sets, config))
                 if all(t.source in ("reasoning_gym", "file") for t in sections)  # in a thread:
                 else asyncio.ensure_future(asyncio.to_thread(make_task_sets, config)))  # servers
    reaper, locks = Reaper(), []  # locks: RUN_DIR/.lock, once the config is known to be good
    forkservers = _start_forkservers(config, agent, training, reaper)
    await asyncio.sleep(0)  # each start runs up to its process's spawn
    try:
        services, cluster = await _build(config, agent, training, locks, task_sets, reaper,
                                         forkservers)
        async with _running(services, cluster):
            yield services
    finally:
        for started in forkservers.values():
            if (server := await started) is not None:  # None: it could not start
                await server.close()
        reaper.close()
        for fd in locks:
            os.close(fd)


def _start_forkservers(config: Config, agent: Agent | None, training: bool,
                       reaper: Reaper) -> dict[tuple[str, ...], asyncio.Future]:
    """The fork servers of the run's Python script agents ([agent] and [[domains]] agents of a
    training run without an agent callable), by preload; started, not yet awaited."""
    forkservers: dict[tuple[str, ...], asyncio.Future] = {}
    if not training:
        return forkservers
    agents = [] if agent is not None or config.agent is None else [config.agent]
    for agent_cfg in [a for a in agents + [d.agent for d in config.domains] if a and a.command]:
        preload = preload_of(agent_command(agent_cfg), agent_cfg)
        if preload and preload not in forkservers:
            forkservers[preload] = start_forkserver(preload, reaper.env())
    return forkservers


async def _build(config: Config, agent: Agent | None, training: bool, locks: list[int],
                 task_sets: Awaitable, reaper: Reaper,
                 forkservers: dict) -> tuple[Services, Any]:
    """(Services, RayCluster or None): every service built and the gateway listening; appends
    the RUN_DIR lock's descriptor to `locks` (the caller closes it, also when this raises)."""
    # lazy (each): torch and transformers load after cli.main's share_malloc_arena
    import torch  # lazy: heavy, see above

    from forgerl.controller.warmstart import load_demos  # lazy: the gateway imports torch
    from forgerl.cpu_share import single_threaded_caller  # lazy: torch
    from forgerl.gateway.app import Gateway  # lazy: torch, transformers
    from forgerl.gateway.renderers.templates import build_renderer  # lazy: transformers
    from forgerl.models import load_policy  # lazy: torch, transformers
    from forgerl.trainer.data_parallel import build_trainer  # lazy: torch
    from forgerl.trainer.lora import PolicyAdapter, check_targets  # lazy: torch

    tasks, eval_tasks = await task_sets  # before anything is opened: it may raise
    # before any parallel op here: only the engine's and the trainer's threads run OpenMP teams
    cores = single_threaded_caller() if _shares_cpu(config) else None
    torch.manual_seed(config.seed)
    model, tokenizer, system = load_policy(config.model.path)
    warn_positions(config.model.max_model_len, model.config)
    models = load_models(config, tokenizer)  # [[policies]] after the first: may refuse too
    if config.model.lora is not None:  # its targets are refused before anything is written
        check_targets(model, config.model.lora.targets)
    gc = config.gateway  # the renderer may refuse the tokenizer: before anything is written
    renderer = build_renderer(tokenizer, gc.renderer, gc.tool_parser, default_system=system,
                              eos_ids=eos_ids(model)).bind(gc.chat_template_kwargs)
    # demonstrations are read (and refused) before anything is written; not once the run's
    # checkpoint is past the warm start
    ws = config.warmstart
    demos = (load_demos(ws.demos or "", renderer, config.trainer.max_row_tokens)
             if training and ws.steps > checkpoint_step(config.run_dir) else [])
    run_dir, lock = open_run_dir(config)
    locks.append(lock)
    if training and agent is None:  # after the lock, before anything of the run is written
        for section in (config.agent, *(d.agent for d in config.domains)):
            check_agent_command(section)
    pool = open_pool(config.datapool.location(run_dir))  # an unreachable server fails fast
    if training and config.datapool.url:  # a database shared with another run is refused
        claim_pool(run_dir, pool)
    trainer = build_trainer(config, model)
    if config.model.lora is not None:  # on the trainer's device, before the resume loads it
        trainer.attach_lora(PolicyAdapter.wrap(trainer.model, config.model.lora, config.seed,
                                               config.model.path))
    scheduler_state = resume(run_dir, trainer, config.model.path)  # see rundir.py
    scheduler = Scheduler.build(config.scheduler, config.rollout, pool, scheduler_state)
    engine, cluster = await _start_engines(config, trainer, run_dir, cores)
    policies = await build_policies(  # each its own trainer and engine
        config, models, run_dir, lambda t: _start_engines(config, t, run_dir, cores))
    gateway = Gateway(renderer, engine, pool,
                      config.gateway.model_name, temperature=config.rollout.temperature,
                      max_tokens=config.rollout.max_tokens, strict=config.gateway.strict,
                      controller_tasks=training, admin_key=gc.admin_key or admin_key(run_dir),
                      loopback_sessions=gc.admin_key is None,
                      session_idle_timeout_s=config.gateway.session_idle_timeout_s,
                      untrained_models=frozenset(gc.untrained_models),
                      responses_token_ids=gc.responses_token_ids,
                      untrained_traces=tuple(map(re.compile, gc.untrained_traces)),
                      template_kwargs=dict(gc.chat_template_kwargs),
                      policies={name: p.engine for name, p in policies.items()})
    log = gc.request_log if isinstance(gc.request_log, str) else (
        run_dir / "requests.jsonl" if gc.request_log else None)
    try:
        server = await gateway.serve(gc.host, gc.port, request_log=log, metrics=gc.metrics)
    except OSError as e:  # a taken port, a host that does not resolve (socket.gaierror)
        raise ConfigError(f"gateway.host / gateway.port: cannot listen on {config.gateway.host}:"
                          f"{config.gateway.port} ({e.strerror or e})") from e
    save_config(run_dir, config)
    if agent is None and config.agent is not None and config.agent.command:
        agent = agent_command(config.agent)
    services = Services(config, run_dir, trainer, engine, pool, gateway, server, scheduler, tasks,
                        eval_tasks, agent, MetricsLogger(run_dir, trainer.step), reaper,
                        demos=demos, forkservers=forkservers, policies=policies)
    if config.domains:  # per-domain entropy (`Trainer.domain_of`)
        trainer.domain_of = services.domain_of
    services.domain_agents = {d.name: (agent_command(d.agent), d.agent) for d in config.domains
                              if d.agent is not None and d.agent.command}
    if training:  # the environments of the run's domains (forgerl/tasks/); `_running` starts them
        sections = [(d.name, d.tasks) for d in config.domains] or [("", config.tasks)]
        for name, tasks_cfg in sections:
            if (environment := build_environment(tasks_cfg)) is not None:
                services.environments[name] = environment
    return services, cluster


def warn_positions(max_model_len: int, model_config: Any) -> str | None:
    """Warn (log once, at start) when `max_model_len` exceeds the positions the model was
    trained on (HF config `max_position_embeddings`; SmolLM2: 8192): positions past them are
    extrapolated and replies degrade. Returns the warning, None when there is none."""
    trained = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(trained, int) or max_model_len <= trained:
        return None
    message = (f"model.max_model_len ({max_model_len}) exceeds the {trained} positions the model "
               f"was trained on (max_position_embeddings): longer contexts may degrade")
    log.warning(message)
    return message


@contextlib.asynccontextmanager
async def _running(services: Services, cluster: Any) -> AsyncIterator[None]:
    """Start the environments, then the data-parallel trainer's ranks 1.. (from rank 0's state);
    on the way out, a failed start's too, stop everything `_build` and this started."""
    from forgerl.trainer.data_parallel import DataParallelTrainer, TrainerWorkers  # lazy: torch

    s, workers = services, None
    try:
        for environment in s.environments.values():  # one that fails stops all (finally)
            await environment.start()
        if isinstance(s.trainer, DataParallelTrainer):  # ranks 1.. start from rank 0's state
            start = (functools.partial(TrainerWorkers, s.config, s.run_dir) if cluster is None
                     else functools.partial(cluster.trainer_workers, s.trainer))
            s.trainer.workers = workers = await asyncio.to_thread(start)
        yield
    finally:
        s.closing = True
        for task in list(s.rollouts.values()):
            task.cancel()
        await asyncio.gather(*s.rollouts.values(), return_exceptions=True)
        await s.server.stop()
        for environment in s.environments.values():
            with contextlib.suppress(Exception):  # one environment's failed stop stops no other
                await environment.stop()
        await s.engine.close()
        for policy in s.policies.values():
            await policy.engine.close()
        s.logger.close()
        s.pool.close()
        if workers is not None:
            workers.close()
        if cluster is not None:
            cluster.close()


def _shares_cpu(config: Config) -> bool:
    """Whether a CPU trainer shares this process's cores with one local engine (`CpuShare`).
    Raises ValueError for a trainer.device the trainer would refuse (`resolve_device`)."""
    from forgerl.trainer.trainer import resolve_device  # lazy: torch

    ec = config.engine
    return (resolve_device(config.trainer.device).type == "cpu" and ec.type == "local"
            and config.cluster.backend != "ray" and ec.instances == 1 and not ec.disaggregated)


async def _start_engines(config: Config, trainer: Any, run_dir: Path,
                         cores: int | None = None) -> tuple[Any, Any]:
    """(rollout engine, RayCluster or None) for `config`: local engines in this process, Ray
    engine actors, a remote vLLM server, or vLLM in this process; a Router before several
    instances. Every engine serves the trainer's weights as weight_version = trainer.step.
    cores: the CPU's threads where the trainer and one local engine share it (`_shares_cpu`):
    both get one CpuShare.
    Raises RuntimeError when no server answers at engine.base_url, ConfigError for type "vllm"
    without vLLM installed."""
    # lazy (each): torch and the engines load after cli.main's share_malloc_arena
    from forgerl.cpu_share import CpuShare  # lazy: torch
    from forgerl.engines.local import LocalEngine  # lazy: torch
    from forgerl.models import engine_dtype  # lazy: torch

    ec, cluster = config.engine, None
    if config.cluster.backend == "ray":
        from forgerl.cluster import RayCluster  # lazy: optional extra (ray)

        cluster = await asyncio.to_thread(RayCluster, config)
        engines = await asyncio.to_thread(cluster.engines)
    elif ec.type == "remote":
        from forgerl.engines.remote import RemoteEngine  # lazy: only this engine type's import

        urls = [ec.base_url] if isinstance(ec.base_url, str) else ec.base_url
        folder = Path(ec.weights_dir or run_dir / "engine_weights")
        engines = [RemoteEngine(url, config.model.max_model_len,  # a folder per server
                                weights_dir=folder / str(i) if len(urls) > 1 else folder,
                                timeout_s=ec.timeout_s, retries=ec.retries)
                   for i, url in enumerate(urls)]
        for url, healthy in zip(urls, await asyncio.gather(*(e.health() for e in engines)),
                                strict=True):
            if not healthy:
                raise RuntimeError(f"engine.base_url: no vLLM server answers at {url}/health")
    elif ec.type == "vllm":
        try:
            from forgerl.engines.vllm import VllmEngine  # lazy: optional extra (vllm)
        except ImportError as exc:
            raise ConfigError(f"engine.type = \"vllm\" needs vLLM in this Python ({exc}): run "
                              "`bash scripts/setup_vllm.sh`, then `.venv-vllm/bin/python -m "
                              "forgerl ...`") from exc
        engines = [await asyncio.to_thread(VllmEngine.from_config, config)]
    else:  # each engine keeps its own copy of the weights
        dtype = engine_dtype(ec.dtype, trainer.device)
        if cores is not None:  # one CPU, two busy threads
            trainer.cpu_share = CpuShare(cores)
        if ec.speculative_tokens:  # a draft head, warmed up on the policy, trained online
            await asyncio.to_thread(_attach_drafter, trainer, ec, config.run_dir)
        kv_pool = _kv_pool(ec.kv_pool, ec.kv_pool_bytes, _block_bytes(trainer.model, dtype))
        if ec.disaggregated:
            from forgerl.engines.disaggregated import DisaggregatedEngine  # lazy: as LocalEngine

            engines = [DisaggregatedEngine(trainer.model, config.model.max_model_len,
                                           ec.max_batch_size, ec.prefix_cache_tokens, dtype,
                                           ec.packed_weights) for _ in range(ec.instances)]
        else:
            engines = [LocalEngine(trainer.model, max_model_len=config.model.max_model_len,
                                   max_batch_size=ec.max_batch_size, device=str(trainer.device),
                                   prefix_cache_tokens=ec.prefix_cache_tokens, dtype=dtype,
                                   packed_weights=ec.packed_weights, cpu_share=trainer.cpu_share,
                                   drafter=trainer.drafter,
                                   speculative_tokens=ec.speculative_tokens, kv_pool=kv_pool)
                       for _ in range(ec.instances)]
    if len(engines) == 1:
        engine = engines[0]
    else:
        from forgerl.gateway.router import Router  # lazy: torch, as the engines
        engine = Router(engines, ec.router, ec.prefix_cache_tokens, ec.max_batch_size,
                        kv_pool=getattr(engines[0], "kv_pool", None))
    if cluster is not None or ec.type != "local" or trainer.lora is not None:
        # actors, servers and vLLM start from the config's weights, local engines from the
        # base's (a LoRA run's adapter is merged in): send the trainer's
        await engine.update_weights(trainer.state_dict_for_sync(), trainer.step)
    engine.weight_version = trainer.step
    return engine, cluster


def _attach_drafter(trainer: Any, ec: Any, run_dir: Any) -> None:
    """Give `trainer` an MTP draft head (`forgerl.drafter`): the one saved in RUN_DIR's newest
    checkpoint (with its AdamW state), else a fresh one distilled for
    ec.drafter_warm_start_steps steps on 16 of the policy's own 64-token samples."""
    from forgerl.drafter import Drafter, policy_samples, warm_start  # lazy: torch

    drafter = Drafter.for_model(trainer.model)
    ckpt = latest_checkpoint(run_dir)
    if (saved := ckpt and load_drafter(ckpt)) is not None:
        trainer.attach_drafter(drafter, ec.drafter_lr, ec.drafter_top_k)
        trainer.load_drafter_state(saved)
        return
    if ec.drafter_warm_start_steps:
        samples = policy_samples(trainer.model, 16, 64)
        warm_start(drafter, trainer.model, samples, ec.drafter_warm_start_steps, k=ec.drafter_top_k)
    trainer.attach_drafter(drafter, ec.drafter_lr, ec.drafter_top_k)


def _block_bytes(model: Any, dtype: Any) -> int:
    """Bytes of one KV-pool block (BLOCK tokens) of `model`'s KV in `dtype`."""
    from forgerl.engines.blocks import BLOCK  # lazy: as the engines

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return BLOCK * 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dtype.itemsize


def _kv_pool(kind: str, max_bytes: int, block_bytes: int = 0) -> Any:
    """The local engines' KV pool for `[engine] kv_pool` (None for "off"); a "shared" pool's
    process stops when this one exits. ConfigError when `max_bytes` cannot hold one block of
    `block_bytes` (the pool would silently hold nothing)."""
    from forgerl.engines.kv_pool import KVPool, SharedKVPool  # lazy: torch

    if kind != "off" and max_bytes < block_bytes:
        raise ConfigError(f"engine.kv_pool_bytes ({max_bytes}) cannot hold one KV block of this "
                          f"model ({block_bytes} bytes, 16 tokens)")
    if kind == "process":
        return KVPool(max_bytes)
    if kind == "shared":
        folder = tempfile.mkdtemp(prefix="forgerl-kv-")
        pool = SharedKVPool.start(Path(folder) / "pool.sock", max_bytes)
        atexit.register(shutil.rmtree, folder, True)  # atexit runs last in, first out:
        atexit.register(pool.close)  # the pool stops, then its folder goes
        return pool
    return None


def eos_ids(model: Any) -> list[int]:
    """The model's `generation_config.eos_token_id` as a list (an int or a list there; [] when
    unset): the ids its family ends a reply with, stop ids of the gateway's renderer."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
