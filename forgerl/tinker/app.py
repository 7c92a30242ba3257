"""The Tinker REST API over a `TinkerService`: the endpoints the `tinker` SDK (0.38) calls.

Data flow: a call that computes (create_model, forward_backward, optim_step, save/load weights,
asample) is queued as a job and answered at once with a future `{"request_id"}`; ONE worker
thread runs the jobs in arrival order (the SDK sends a training client's calls in seq_id order,
each after the previous one was accepted, so gradients accumulate before their optim_step); the
SDK polls `POST /api/v1/retrieve_future`, which waits up to RETRIEVE_WAIT_S for the job and then
answers the result (JSON, or protobuf for ForwardBackwardOutput and SampleResponse), a
`{"error", "category"}` failure, or `{"type": "try_again"}`. Sessions, heartbeats, client
config and telemetry are accepted and answered with defaults. Any API key is accepted.

Errors: a bad request is a JSON 400 `{"error": message, "category": "user"}`; an unknown path
a JSON 404; an unexpected failure a JSON 500 with one line (the traceback goes to the log).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from tinker import types as tt

from forgerl.tinker import wire
from forgerl.tinker.sampling import EngineSampler, sample
from forgerl.tinker.service import TinkerError, TinkerService

log = logging.getLogger(__name__)
RETRIEVE_WAIT_S = 20.0
"""How long one retrieve_future waits for its job before answering try_again."""
KEPT_RESULTS = 4096
"""Finished results kept for retrieval (oldest dropped first)."""
PROTO = "application/x-protobuf"


class _Job:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.done = asyncio.Event()
        self.loop = loop
        self.result: Response | None = None


class Jobs:
    """Jobs run one at a time on a worker thread, in submission order; results by request id."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[_Job, Callable[[], Response]] | None] = (
            queue.SimpleQueue())
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._work, name="forgerl-tinker", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Response], **extra: Any) -> dict[str, Any]:
        """Queue `fn`; returns the future's JSON (request_id plus `extra`)."""
        rid = f"req{next(self._ids)}"
        job = self._jobs[rid] = _Job(asyncio.get_running_loop())
        while len(self._jobs) > KEPT_RESULTS:
            self._jobs.popitem(last=False)
        self._queue.put((job, fn))
        return {"request_id": rid, **extra}

    def submit_async(self, coro: Callable[[], Awaitable[Response]], **extra: Any
                     ) -> dict[str, Any]:
        """Run `coro()` as a task of the running loop (beside the worker's jobs)."""
        rid = f"req{next(self._ids)}"
        job = self._jobs[rid] = _Job(asyncio.get_running_loop())

        async def run() -> None:
            job.result = await _answer(coro)
            job.done.set()
        self._tasks.add(task := asyncio.create_task(run()))
        task.add_done_callback(self._tasks.discard)
        return {"request_id": rid, **extra}

    async def retrieve(self, rid: str) -> Response:
        job = self._jobs.get(rid)
        if job is None:
            return _error(f"unknown or expired request_id {rid!r}", 410)
        try:
            await asyncio.wait_for(job.done.wait(), RETRIEVE_WAIT_S)
        except TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": rid,
                                 "queue_state": "active"})
        assert job.result is not None
        return job.result

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            job, fn = item
            try:
                job.result = fn()
            except TinkerError as exc:
                job.result = JSONResponse({"error": str(exc), "category": "user"})
            except Exception as exc:
                log.exception("tinker job failed")
                job.result = JSONResponse({"error": f"{type(exc).__name__}: {exc}",
                                           "category": "server"})
            job.loop.call_soon_threadsafe(job.done.set)

    def close(self) -> None:
        self._queue.put(None)


async def _answer(coro: Callable[[], Awaitable[Response]]) -> Response:
    try:
        return await coro()
    except TinkerError as exc:
        return JSONResponse({"error": str(exc), "category": "user"})
    except Exception as exc:
        log.exception("tinker job failed")
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}", "category": "server"})


def _error(message: str, status: int = 400, category: str = "user") -> JSONResponse:
    return JSONResponse({"error": message, "category": category, "detail": message}, status)


def _json(model: BaseModel | dict[str, Any]) -> Response:
    body = model if isinstance(model, dict) else model.model_dump(mode="json", exclude_none=True)
    return JSONResponse(body)


async def _parse(request: Request, cls: type[BaseModel]) -> Any:
    try:
        return cls.model_validate(await request.json())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise TinkerError(f"{cls.__name__}: {where}: {first['msg']}") from None
    except ValueError as exc:
        raise TinkerError(f"body is not JSON: {exc}") from None


def build_app(service: TinkerService, tokenizer: Any = None,
              engine: EngineSampler | None = None) -> FastAPI:
    """The FastAPI app; `tokenizer` (optional) decodes completions for stop strings; `engine`
    (optional) samples instead of the worker thread, batching the rows of every sampler."""
    app, jobs = FastAPI(title="ForgeRL Tinker API"), Jobs()
    app.state.jobs = jobs
    samplers: dict[str, str | None] = {}  # sampling_session_id → checkpoint path (None: base)
    name = service.served_name
    decode = tokenizer.decode if tokenizer is not None else None

    @app.exception_handler(TinkerError)
    async def _user(_: Request, exc: TinkerError) -> Response:
        return _error(str(exc))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Response:
        return _error(f"{exc.detail}", exc.status_code)

    @app.exception_handler(Exception)
    async def _server(_: Request, exc: Exception) -> Response:
        log.exception("tinker request failed")
        return _error(f"{type(exc).__name__}: {exc}", 500, "server")

    def check_model(base_model: str | None) -> None:
        if base_model is not None and base_model != name:
            raise TinkerError(f"base_model {base_model!r} is not served; this server serves "
                              f"{name!r}")

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {"parallel_fwdbwd_chunks": False}  # one chunk after another, in seq_id order

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        await _parse(request, tt.CreateSessionRequest)
        return {"type": "create_session", "session_id": f"session-{uuid.uuid4().hex[:12]}"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat() -> dict[str, str]:
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.post("/api/v1/cancel_future")
    async def cancel() -> dict[str, str]:
        return {}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True,
                                      "max_context_length": service.max_model_len}]}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        req = await _parse(request, tt.CreateModelRequest)
        check_model(req.base_model)
        if req.lora_config is None:
            raise TinkerError("only LoRA training is served: give lora_config (a rank)")
        cfg, model_id = req.lora_config, f"{req.session_id}:train:{req.model_seq_id}"
        return jobs.submit(lambda: _json({"type": "create_model", "model_id": service.create(
            cfg.rank, cfg.seed, model_id)}))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        req = await _parse(request, tt.GetInfoRequest)
        run = service.run(req.model_id)
        return {"type": "get_info", "model_id": run.model_id, "is_lora": True,
                "lora_rank": run.rank, "model_name": name,
                "model_data": {"arch": type(service.model).__name__, "model_name": name,
                               "tokenizer_id": name}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        model_id, data, loss_fn, config, forward_only = wire.forward_backward_request(
            await request.body(), request.headers.get("content-encoding"))
        service.run(model_id)

        def job() -> Response:
            lps, metrics = service.forward_backward(model_id, data, loss_fn, config,
                                                    backward=not forward_only)
            return Response(wire.forward_backward_output(lps, metrics), media_type=PROTO)
        return jobs.submit(job, model_id=model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        req = await _parse(request, tt.OptimStepRequest)  # a bad body: a 400, not a retried 500
        adam, model_id = req.optim_params, req.model_id
        if not isinstance(adam, tt.AdamParams):
            raise TinkerError(f"only AdamParams are served, got {type(adam).__name__}")
        return jobs.submit(lambda: _json({"metrics": service.optim_step(
            model_id, adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay,
            adam.grad_clip_norm)}), model_id=model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        req = await _parse(request, tt.SaveWeightsRequest)
        return jobs.submit(lambda: _json({"type": "save_weights", "path": service.save(
            req.model_id, req.path, "weights")}), model_id=req.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        req = await _parse(request, tt.SaveWeightsForSamplerRequest)

        def job() -> Response:
            path = service.save(req.model_id, req.path, "sampler_weights")
            out = {"type": "save_weights_for_sampler", "path": path}
            if req.sampling_session_seq_id is not None:
                out["sampling_session_id"] = sid = f"sampler-{uuid.uuid4().hex[:12]}"
                samplers[sid] = path
            return _json(out)
        return jobs.submit(job, model_id=req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        req = await _parse(request, tt.LoadWeightsRequest)
        check_model(req.base_model)
        service.folder(req.path)
        new_id = (f"{req.session_id}:train:{req.model_seq_id}" if req.session_id is not None
                  else None)  # create-via-load: the SDK names the run itself
        return jobs.submit(lambda: _json({"type": "load_weights", "path": req.path,
                                          "model_id": service.load(req.path, req.optimizer,
                                                                   req.model_id, new_id)}))

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        req = await _parse(request, tt.CreateSamplingSessionRequest)
        check_model(req.base_model)
        if req.model_path is not None:
            service.folder(req.model_path)
        samplers[sid := f"sampler-{uuid.uuid4().hex[:12]}"] = req.model_path
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        if sampler_id not in samplers:
            raise TinkerError(f"unknown sampler {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": name, "model_path": samplers[sampler_id]}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        req = await _parse(request, tt.SampleRequest)
        if req.sampling_session_id is not None:
            if req.sampling_session_id not in samplers:
                raise TinkerError(f"unknown sampling_session_id {req.sampling_session_id!r}")
            path = samplers[req.sampling_session_id]
        else:
            check_model(req.base_model)
            path = req.model_path
        prompt = req.prompt.to_ints()
        params = req.sampling_params.model_dump()
        ids = [f"seq-{uuid.uuid4().hex[:12]}" for _ in range(req.num_samples)]
        if engine is not None and not req.prompt_logprobs:
            async def sampled() -> Response:
                seqs = await engine.sample(path, prompt, req.num_samples, params, decode)
                return Response(wire.sample_response(seqs, None), media_type=PROTO)
            return jobs.submit_async(sampled, sample_sequence_ids=ids)

        def job() -> Response:
            seqs, lp = sample(service, path, prompt, req.num_samples, params, decode,
                              bool(req.prompt_logprobs))
            return Response(wire.sample_response(seqs, lp), media_type=PROTO)
        return jobs.submit(job, sample_sequence_ids=ids)

    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request) -> Response:
        req = await _parse(request, tt.FutureRetrieveRequest)
        return await jobs.retrieve(req.request_id)

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(rest: str) -> Response:
        return _error(f"/{rest} is not served by ForgeRL's Tinker API (docs/tinker.md)", 404)

    return app
