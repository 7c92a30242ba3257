"""Start the online service: `start_online` (Python: tests, benchmarks, embedders with their
own scrub hook and verifier) and `serve_online` (`forgerl serve CONFIG` with an [online]
section: the [model], [trainer] lr, [gateway] and [tasks] held-out set of the config)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forgerl.config import Config, OnlineConfig
from forgerl.controller.rundir import admin_key as saved_admin_key
from forgerl.controller.tasks import make_task_sets
from forgerl.datapool import open_pool
from forgerl.engines.local import LocalEngine
from forgerl.gateway.app import Gateway, GatewayServer
from forgerl.gateway.renderers.templates import build_renderer
from forgerl.models import load_policy
from forgerl.online.canary import CanaryEngine
from forgerl.online.privacy import PrivatePool, Scrubber, regex_scrub
from forgerl.online.routes import online_app
from forgerl.online.service import SERVED, HeldOut, OnlineService
from forgerl.rewards.reasoning_gym import score
from forgerl.trainer.trainer import Trainer


@dataclass
class Online:
    """A running online service: `service`, its HTTP `server` (base_url), the background
    trainer task (None when not started)."""

    service: OnlineService
    server: GatewayServer
    trainer_task: asyncio.Task | None

    async def close(self) -> None:
        """Stop the trainer task, the server, both engines; close the pool."""
        if self.trainer_task is not None:
            self.trainer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.trainer_task
        await self.server.stop()
        await self.service.engine.close()
        self.service.pool.pool.close()


async def start_online(model: Any, tokenizer: Any, run_dir: str | Path, config: OnlineConfig,
                       held_out: HeldOut, admin_key: str, *, lr: float = 1e-5,
                       scrub: Scrubber | None = regex_scrub, host: str = "127.0.0.1",
                       port: int = 0, max_model_len: int = 1024, max_tokens: int = 256,
                       model_name: str = "policy", background: bool = True, seed: int = 0,
                       device: str = "auto", pool_at: str | Path | None = None) -> Online:
    """Serve `model` (it becomes the trainer's; each engine keeps its own copy) with the online
    routes; `background`: run `OnlineService.run` as a task. `pool_at`: a PostgreSQL URL or SQLite
    path (`open_pool`); None: RUN_DIR/pool.sqlite.
    When RUN_DIR/online_served.pt exists (an earlier promotion) its weights and version serve
    instead of `model`'s own, and the trainer's step count resumes at that version."""
    run_dir = Path(run_dir)
    served = None
    if (run_dir / SERVED).exists():  # the last promoted weights of an earlier process
        served = torch.load(run_dir / SERVED, map_location="cpu", weights_only=True)
        model.load_state_dict(served["state"], strict=False)
    trainer = Trainer(model, lr=lr, device=device)
    engines = [LocalEngine(trainer.model, max_model_len=max_model_len) for _ in range(2)]
    if served is not None:
        trainer.step = served["version"]
        await engines[0].update_weights(trainer.state_dict_for_sync(), served["version"])
    renderer = build_renderer(tokenizer)
    pool = PrivatePool(open_pool(pool_at or run_dir / "pool.sqlite"), renderer.decode, scrub)
    engine = CanaryEngine(engines[0], engines[1], config.canary_share, seed)
    gateway = Gateway(renderer, engine, pool, model_name, max_tokens=max_tokens,
                      admin_key=admin_key)
    service = OnlineService(gateway, pool, engine, trainer, held_out, config, run_dir)
    server = GatewayServer(online_app(service), host, port)
    await server.start()
    task = asyncio.create_task(service.run()) if background else None
    return Online(service, server, task)


async def serve_online(config: Config) -> None:
    """`forgerl serve CONFIG`: serve until cancelled. Raises ValueError without [online]."""
    if config.online is None:
        raise ValueError("online: forgerl serve needs an [online] section (docs/online.md)")
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer, _ = load_policy(config.model.path)
    _, held = make_task_sets(config)
    if not held:
        raise ValueError("tasks.eval_size: the online gate needs a held-out set (> 0)")
    held_out = HeldOut(held, score, config.rollout.max_tokens, config.online.held_out_samples,
                       seed=config.seed)
    gc = config.gateway
    key = gc.admin_key or saved_admin_key(run_dir)
    online = await start_online(
        model, tokenizer, run_dir, config.online, held_out, key, lr=config.trainer.lr,
        scrub=regex_scrub if config.online.scrub == "regex" else None,
        host=config.serve.host, port=config.serve.port, max_model_len=config.model.max_model_len,
        max_tokens=config.rollout.max_tokens, model_name=gc.model_name, seed=config.seed,
        pool_at=config.datapool.location(run_dir))
    print(f"ForgeRL online at {online.server.base_url} (model {gc.model_name!r})"
          + ("" if gc.admin_key else f"; admin key in {run_dir / 'admin_key'}"), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await online.close()
