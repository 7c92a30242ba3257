"""`LocalEngine`: the local engine's public API (event-loop side), checks and worker thread.

Data flow: `stream` / `generate` / `update_weights` / `apply_delta` run on the caller's event
loop, check their arguments and put a `_Request` or a `WeightUpdate` into the inbox of the
`ThreadWorker` shell (forgerl/engines/worker.py); the worker thread (`_run`) applies weight
updates between steps and runs `ContinuousBatcher._step` (batcher.py) while rows run or wait.
See the package docstring (forgerl/engines/local/__init__.py) for the whole loop.
"""

from __future__ import annotations

import asyncio
import copy
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from forgerl.cpu_share import CpuShare
from forgerl.drafter import PREFIX, Drafter
from forgerl.engines.base import TokenEvent
from forgerl.engines.kv_pool import KVPool
from forgerl.engines.local.adapters import AdapterLoad
from forgerl.engines.local.batcher import ContinuousBatcher
from forgerl.engines.local.kernels import ENGINE_SDPA, pack_linears
from forgerl.engines.local.kv_batch import _fail, _Request
from forgerl.engines.local.prefix_cache import KV, PrefixCache
from forgerl.engines.local.routes import RouteRecorder
from forgerl.engines.worker import ThreadWorker, WeightUpdate
from forgerl.models import router_modules
from forgerl.types import GenerateOutput, SamplingParams
from forgerl.weights import WeightDelta, apply_delta


@dataclass(frozen=True)
class _Prefix:
    """KV for token ids offered by `LocalEngine.insert_prefix`, built under weights `version`."""

    ids: tuple[int, ...]
    kv: KV
    version: int


class LocalEngine(ContinuousBatcher, ThreadWorker):
    """A transformers rollout engine with continuous batching and versioned weights.

    model: a causal LM (e.g. LlamaForCausalLM); the engine deep-copies it and never touches the
    caller's object. max_model_len: prompt + completion tokens per request. max_batch_size: most
    rows decoded together. device: "cpu", "cuda", ...; default CUDA when available, else CPU.
    dtype: the weights' dtype; default fp32 on CPU (bf16 is slow without AMX or AVX512-BF16:
    `forgerl.models.engine_dtype`), else the model's own. The worker uses torch's intra-op
    threads; on a small, busy CPU `torch.set_num_threads(1)` can be far faster for small models.
    prefix_cache_tokens: bound of the prefix (KV reuse) cache in tokens, 0 disables it; memory
    is 2 · layers · kv_heads · head_dim · 4 bytes per token in fp32 (SmolLM2-135M: 46 KB).
    packed_weights: on CPU in float32, run the linears on oneDNN-packed copies of their weights
    (`pack_linears`; rebuilt after every update), else ignored.
    cpu_share: a `forgerl.cpu_share.CpuShare` the worker enters as "engine" before each step
    and leaves when idle, so it runs half of the CPU's threads while the trainer trains (and
    its prefills always: `CpuShare.threads("prefill")`).
    stats: worker counters, "prefill_tokens" (tokens run through prefill forwards),
    "prefix_hits" (prefilled rows that reused cached KV) and "prefix_hit_tokens" (tokens reused),
    plus the configured "max_batch_size" and "queued_peak", the most requests ever waiting
    behind that limit (requests beyond it queue in arrival order; none is refused or dropped),
    and the decode loop's own time: "decode_steps" (batched one-token forwards),
    "decode_rows" (rows in them: decode_rows / decode_steps is the mean batch occupancy, and
    decode_rows / decode_seconds the engine's decode rate in tokens/s), "decode_seconds" and
    "prefill_seconds" (wall seconds in decode steps and in prefills), and "cpu_shared_steps"
    (steps run on half of the cores beside the trainer, `cpu_share`), "pool_hits" and
    "pool_hit_tokens" (prefills that fetched a longer prefix from `kv_pool`, and the tokens
    fetched beyond the local hit; both also count in prefix_hits / prefix_hit_tokens),
    "handoffs_stale" (KV offered by `insert_prefix` under an older weight version, dropped).
    A MoE model's routed experts are recorded (`GenerateOutput.routed_experts`, `routes.py`).
    drafter, speculative_tokens: an MTP draft head (`forgerl.drafter.Drafter`, copied) and
    the drafts per speculative decode step (0: off; > 0 needs a drafter; speculative.py). The
    drafter's tensors are engine weights named `drafter.<name>`, updated by `update_weights`
    and `apply_delta` like the policy's; stats then count "spec_steps", "draft_tokens",
    "accepted_tokens" and "spec_tokens".
    kv_pool: a `forgerl.engines.kv_pool.KVPool` shared with other instances (None: off); the
    engine publishes its KV there and fetches prefixes its own cache lacks; a weight update
    advances it to the new version (every older block is dropped).
    LoRA adapters (`load_adapter`, `stream(..., adapter=name)`; adapters.py): rows of different
    adapters decode in one batch; stats count "adapter_loads" (adapter versions loaded).
    """

    _closed_message = "LocalEngine is closed"

    def __init__(
        self,
        model: PreTrainedModel,
        max_model_len: int = 2048,
        max_batch_size: int = 16,
        device: str | None = None,
        prefix_cache_tokens: int = 32768,
        dtype: torch.dtype | None = None,
        packed_weights: bool = False,
        cpu_share: CpuShare | None = None,
        drafter: Drafter | None = None,
        speculative_tokens: int = 0,
        kv_pool: KVPool | None = None,
    ) -> None:
        if speculative_tokens < 0 or (speculative_tokens and drafter is None):
            raise ValueError(f"speculative_tokens ({speculative_tokens}) must be >= 0, and > 0 "
                             "only with a drafter")
        if max_model_len < 2 or max_batch_size < 1 or prefix_cache_tokens < 0:
            raise ValueError(
                f"max_model_len ({max_model_len}) must be >= 2, max_batch_size "
                f"({max_batch_size}) >= 1 and prefix_cache_tokens ({prefix_cache_tokens}) >= 0"
            )
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = copy.deepcopy(model).to(self.device).eval()
        if self.model.config._attn_implementation == "sdpa":
            self.model.config._attn_implementation = ENGINE_SDPA
        if dtype is not None or self.device.type == "cpu":
            self.model = self.model.to(dtype or torch.float32)
        self.max_model_len, self.max_batch_size = max_model_len, max_batch_size
        self.weight_version = 0
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self._params = self.model.state_dict()  # name → tensor sharing the parameter's storage
        if drafter is not None:  # synced with the policy under its prefix (forgerl.drafter)
            self.drafter = copy.deepcopy(drafter).to(self.device, self.weight_dtype).eval()
            self.speculative_tokens = speculative_tokens
            self._params.update({PREFIX + k: v for k, v in self.drafter.state_dict().items()})
            self.watch_hidden()
        self._packed = packed_weights and pack_linears(self.model)
        self.cpu_share = cpu_share
        self._waiting: deque[_Request] = deque()
        self._batch = None
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.recorder = RouteRecorder(self.model) if router_modules(self.model) else None
        if self.recorder and speculative_tokens:  # a draft step would record no routes
            raise ValueError("speculative_tokens > 0 is not supported for a MoE model (its "
                             "routed experts are recorded per decoded token)")
        if self.recorder and kv_pool is not None:  # the pool holds KV, not routes
            raise ValueError("kv_pool is not supported for a MoE model (the pool holds no "
                             "routed experts)")
        self.kv_pool = kv_pool
        self.stats = {"prefill_tokens": 0, "prefix_hits": 0, "prefix_hit_tokens": 0,
                      "max_batch_size": max_batch_size, "queued_peak": 0, "decode_steps": 0,
                      "decode_rows": 0, "decode_seconds": 0.0, "prefill_seconds": 0.0,
                      "cpu_shared_steps": 0, "spec_steps": 0, "draft_tokens": 0,
                      "accepted_tokens": 0, "spec_tokens": 0, "pool_hits": 0,
                      "pool_hit_tokens": 0, "handoffs_stale": 0, "adapter_loads": 0}
        self.adapter_versions = {}
        self._start_worker("forgerl-local-engine")

    # ---- public API (event-loop side) ---------------------------------------------------------

    def load(self) -> dict[str, int]:
        """{"running": rows in the decode batch, "waiting": requests queued behind
        max_batch_size or not yet taken by the worker}, read without a lock (a gauge)."""
        batch = self._batch
        return {"running": len(batch.rows) if batch is not None else 0,
                "waiting": len(self._waiting) + self._inbox.qsize()}

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       adapter: str | None = None) -> GenerateOutput:
        """Generate one completion; concurrent calls share decode steps.

        The last item of `stream(prompt_ids, params)`; cancelling the awaiting task aborts the
        request (its batch slot is freed at the next decode step). Raises ValueError for an
        empty prompt, ids outside [0, vocab_size), params out of range (`SamplingParams.check`),
        or len(prompt_ids) + max_tokens > max_model_len, an `adapter` not loaded; RuntimeError
        after close(). A closed engine ends in-flight requests with "abort". adapter: the LoRA
        adapter to decode under (`load_adapter`), None for the base.
        """
        *_, out = [item async for item in self.stream(prompt_ids, params, adapter)]
        assert isinstance(out, GenerateOutput)  # a stream that does not raise ends with it
        return out

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """Yield each token as a TokenEvent as soon as it is sampled, then the whole completion
        as a GenerateOutput (equal to the events concatenated); see `RolloutEngine.stream` for
        the contract.

        A token reaches the consumer one event-loop wake-up after the worker samples it (it
        waits for no later step); a slow consumer does not slow the engine: unread events queue
        up (at most max_tokens + 1). Closing the iterator or cancelling its consumer marks the
        request cancelled; its row leaves the batch at the end of the next decode step, and that
        step's admissions may take the slot (a request not yet admitted is skipped). Raises as
        `generate`.
        """
        self._check_request(prompt_ids, params)
        if adapter is not None and adapter not in self.adapter_versions:
            raise ValueError(f"LoRA adapter {adapter!r} is not loaded (have "
                             f"{sorted(self.adapter_versions)})")
        loop = asyncio.get_running_loop()
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        req = _Request(list(prompt_ids), params, asyncio.Queue(), loop, generator,
                       adapter=adapter)
        self._inbox.put(req)
        try:
            while True:
                item = await req.events.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, GenerateOutput):
                    return
        finally:  # finished, failed, closed early or cancelled: the worker may drop the row
            req.cancelled = True

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` (all or some of the model's tensors) between decode steps.

        Keys and shapes are checked first (ValueError); on any failure the old weights and
        weight_version stay. In-flight rows are re-prefilled under the new weights, so each later
        token's logprob is exactly the new policy's and its weight_versions entry is `version`.
        """
        self._check_state_dict(state_dict)
        await self._submit_update(state_dict, version)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's KV: 2 · layers · kv_heads · head_dim · the dtype's size."""
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        size = self.weight_dtype.itemsize
        return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * size

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the engine's weights (weight-sync deltas are computed in it)."""
        return next(iter(self._params.values())).dtype

    async def apply_delta(self, delta: WeightDelta, version: int) -> None:
        """Apply a weight-sync delta between decode steps and publish `version`, like
        `update_weights`; raises `forgerl.weights.DeltaMismatch` (old weights and version stay)
        unless the engine holds exactly the weights of `delta.base_version`."""
        await self._submit_update(delta, version)

    def insert_prefix(self, prefix_ids: list[int], kv: KV, version: int) -> None:
        """Offer KV built elsewhere (a prefill process: forgerl/engines/disaggregated.py) for
        `prefix_ids` to the prefix cache; thread-safe, returns at once. kv: per layer (keys,
        values), each (kv_heads, len(prefix_ids), head_dim) in the engine's dtype. The worker
        thread inserts it only if `version` is still its weight_version when it takes it (else it
        counts stats["handoffs_stale"]), and before any request submitted after this call, so a
        request whose prompt extends `prefix_ids` by one token joins the next decode step with
        no prefill forward (batcher.py `_prefill_wave`)."""
        self._inbox.put(_Prefix(tuple(prefix_ids), kv, version))

    # ---- validation ---------------------------------------------------------------------------

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if self._closed:
            raise RuntimeError(self._closed_message)
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        params.check()
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt length ({len(prompt_ids)}) + max_tokens "
                f"({params.max_tokens}) exceeds max_model_len ({self.max_model_len})"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ValueError(
                f"prompt_ids must lie in [0, {self.vocab_size}), got "
                f"[{min(prompt_ids)}, {max(prompt_ids)}]"
            )

    def _check_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if not state_dict:
            raise ValueError("state_dict is empty")
        unknown = [k for k in state_dict if k not in self._params]
        if unknown:
            raise ValueError(f"state_dict has unknown keys: {unknown[:5]}")
        for name, value in state_dict.items():
            if not isinstance(value, torch.Tensor) or value.shape != self._params[name].shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"{name}: expected shape {tuple(self._params[name].shape)}, got {got}"
                )
            if value.is_meta or value.is_complex() or value.is_sparse:
                raise ValueError(f"{name}: a meta, complex or sparse tensor cannot be loaded")

    # ---- worker thread --------------------------------------------------------------------------

    def _run(self) -> None:
        """The decode loop; blocks on the inbox while idle. On close, running, waiting and
        queued requests end with "abort" and queued weight updates raise RuntimeError."""
        self._serve(self._busy, self._shared_step, self._idle)
        for req in (self._batch.rows if self._batch else []) + list(self._waiting):
            req.resolve("abort")
        self._batch, self._waiting = None, deque()
        for item in self._leftovers():
            if isinstance(item, _Request):
                item.resolve("abort")
            elif isinstance(item, WeightUpdate):
                item.settle(RuntimeError(self._closed_message), error=True)

    def _busy(self) -> bool:
        """Whether rows run or wait (the worker then steps instead of blocking)."""
        return self._batch is not None or bool(self._waiting)

    def _idle(self) -> None:
        """Before blocking on an empty inbox: give the trainer the whole CPU (`cpu_share`)."""
        if self.cpu_share is not None:
            self.cpu_share.leave("engine")

    def _shared_step(self) -> None:
        """One `_step`, at half of the cores beside the trainer when `cpu_share` says so."""
        if self.cpu_share is not None:  # a step at half of the cores: counted
            shared = self.cpu_share.enter("engine") < self.cpu_share.cores
            self.stats["cpu_shared_steps"] += shared
        try:
            self._step()
        except Exception as exc:  # never let the worker die with callers waiting
            rows, self._batch = (self._batch.rows if self._batch else []), None
            _fail(rows, exc)

    def _take(self, item: _Request | WeightUpdate | _Prefix) -> None:
        """Move a new request to the waiting queue, insert offered KV built under the current
        weights, or apply a weight update (worker thread)."""
        if isinstance(item, _Request):
            self._waiting.append(item)
        elif isinstance(item, _Prefix):
            stale = item.version != self.weight_version
            self.stats["handoffs_stale"] += stale
            if not stale:
                self.prefix_cache.insert(item.ids, item.kv)
        else:
            self._apply_update(item)

    def _apply_update(self, update: WeightUpdate) -> None:
        """Copy new weights (or apply a delta) in place, restoring the old ones on failure;
        re-prefill all rows. An adapter load goes to `apply_adapter` (adapters.py)."""
        if isinstance(update.weights, AdapterLoad):
            return self.apply_adapter(update)
        try:
            if isinstance(update.weights, WeightDelta):  # all or nothing, against its base
                apply_delta(self._params, update.weights, self.weight_version)
            else:
                self._copy_weights(update.weights)
            if self._packed:
                pack_linears(self.model)
        except Exception as exc:
            update.settle(exc, error=True)
            return
        self.weight_version = update.version
        self.prefix_cache.clear()
        if self.kv_pool is not None:
            self.kv_pool.advance(update.version)
        if self._batch is not None:  # KV caches were built by the old weights: rebuild them
            self._waiting.extendleft(reversed(self._batch.rows))
            self._batch = None
        update.settle(None)

    def _copy_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy tensors into the weights in place. `_check_state_dict` has vetted every key,
        shape and tensor, so no copy can fail half-way and no backup of the old weights is kept
        (a full clone would cost the model's size at every update)."""
        with torch.no_grad():
            for name, value in state_dict.items():
                self._params[name].copy_(value)
