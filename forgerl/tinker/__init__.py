"""The Tinker API (Thinking Machines' training service) served by ForgeRL: `forgerl serve`.

Modules: `service` (LoRA runs on one frozen base model: forward_backward with Tinker's loss
names over ForgeRL's losses, AdamW steps, peft checkpoints), `sampling` (completions of one
prompt under one adapter), `wire` (the SDK's protobuf messages), `app` (the REST endpoints, the
futures and their worker thread). The unmodified `tinker` SDK and tinker-cookbook recipes are
the clients (tests/tinker/); what is and is not served is in docs/tinker.md.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from forgerl.config import Config, ConfigError
from forgerl.engines.local import LocalEngine
from forgerl.gateway.server import GatewayServer
from forgerl.models import load_policy
from forgerl.tinker.app import build_app
from forgerl.tinker.sampling import EngineSampler
from forgerl.tinker.service import TinkerService
from forgerl.trainer.lora import check_targets


def build_service(config: Config) -> tuple[TinkerService, object, LocalEngine]:
    """(service, tokenizer, engine) for `config`: the [model] base, [serve]'s name and LoRA
    settings, checkpoints under run_dir/tinker; the local engine (its own copy of the base,
    [engine] max_batch_size and prefix_cache_tokens) samples."""
    ec = config.engine
    if ec.type != "local":
        raise ConfigError("engine.type: forgerl serve samples with the local engine (\"local\")")
    model, tokenizer, _ = load_policy(config.model.path)
    check_targets(model, config.serve.lora_targets, "serve.lora_targets", head=True)
    engine = LocalEngine(model, config.model.max_model_len, ec.max_batch_size,
                         prefix_cache_tokens=ec.prefix_cache_tokens)  # before MultiLoRA hooks
    eos = tokenizer.eos_token_id
    service = TinkerService(
        model, config.serve.served_model_name or config.model.path,
        Path(config.run_dir) / "tinker", [] if eos is None else [eos],
        config.model.max_model_len, config.serve.lora_alpha, config.serve.lora_targets)
    return service, tokenizer, engine


async def serve(config: Config) -> None:
    """`forgerl serve`: the Tinker API at http://[serve] host:port until cancelled."""
    service, tokenizer, engine = build_service(config)
    app = build_app(service, tokenizer, EngineSampler(service, engine))
    server = GatewayServer(app, config.serve.host, config.serve.port)
    await server.start()
    print(f"ForgeRL Tinker API at http://{server.host}:{server.port} "
          f"(base model {service.served_name!r})", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        app.state.jobs.close()
        await server.stop()
        await engine.close()
