"""Sampling for the Tinker API: `num_samples` completions of one prompt under one adapter.

The rows share the prompt, so they are prefilled as one unpadded batch and decoded together over
a KV cache (transformers' own cache), each row with its own generator (seed + row index when the
request has a seed); tokens and their logprobs come from the local engine's sampler
(`forgerl.engines.local.sampler.sample_tokens`: temperature, top_p, top_k with vLLM's
conventions; the logprob is that of the distribution sampled from).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from forgerl.engines.local.sampler import sample_tokens
from forgerl.tinker.service import SAMPLER_SLOTS, TinkerError, TinkerService
from forgerl.types import SamplingParams


@dataclass
class Sequence_:
    """One completion: token ids, their logprobs (float32) and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (a stop id or string, or eos) | "length"


def _stops(stop: str | Sequence[str] | Sequence[int] | None, eos: Sequence[int]
           ) -> tuple[set[int], list[str]]:
    """(stop ids, stop strings) of Tinker's `stop`: None = the model's eos ids; [] = none."""
    if stop is None:
        return set(eos), []
    if isinstance(stop, str):
        return set(), [stop]
    ids = {s for s in stop if isinstance(s, int)}
    return ids, [s for s in stop if isinstance(s, str)]


def _params(service: TinkerService, prompt: list[int], num_samples: int, params: dict,
            decode: Callable[[list[int]], str] | None
            ) -> tuple[SamplingParams, set[int], list[str]]:
    """(ForgeRL SamplingParams, stop ids, stop strings) of a Tinker request; TinkerError for a
    bad one."""
    if not prompt or not 1 <= num_samples <= 256:
        raise TinkerError(f"need a non-empty prompt and 1 <= num_samples <= 256, got "
                          f"{len(prompt)} tokens and {num_samples}")
    room = service.max_model_len - len(prompt)
    max_tokens = params.get("max_tokens") or room
    if room < 1 or max_tokens > room:
        raise TinkerError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) > "
                          f"max_model_len ({service.max_model_len})")
    stop_ids, stop_strs = _stops(params.get("stop"), service.eos_ids)
    if stop_strs and decode is None:
        raise TinkerError("stop strings need a tokenizer on the server")
    sp = SamplingParams(temperature=float(params.get("temperature", 1.0)),
                        top_p=float(params.get("top_p", 1.0)),
                        top_k=max(int(params.get("top_k", -1)), 0), max_tokens=max_tokens)
    try:
        sp.check()  # the same bounds for the worker and the engine, a user error
    except ValueError as exc:
        raise TinkerError(f"sampling_params: {exc}") from None
    service.check_ids(prompt)
    return sp, stop_ids, stop_strs


def _cut(seq: Sequence_, stop_strs: list[str], decode: Callable[[list[int]], str] | None
         ) -> Sequence_:
    """`seq` ended after its first token that completes a stop string (stop_reason "stop")."""
    for n in range(1, len(seq.tokens) + 1) if stop_strs and decode else ():
        if any(s in decode(seq.tokens[:n]) for s in stop_strs):
            return Sequence_(seq.tokens[:n], seq.logprobs[:n], "stop")
    return seq


@torch.no_grad()
def sample(service: TinkerService, path: str | None, prompt: list[int], num_samples: int,
           params: dict, decode=None, prompt_logprobs: bool = False
           ) -> tuple[list[Sequence_], np.ndarray | None]:
    """Sample `num_samples` completions of `prompt` from the sampler snapshot at `path` (None:
    the base model). params: Tinker's SamplingParams as a dict (max_tokens, temperature, top_p,
    top_k, seed, stop). decode: ids → text, needed for stop strings. Returns the sequences and,
    with `prompt_logprobs`, the prompt's logprobs (len(prompt),) float32 with NaN first."""
    sp, stop_ids, stop_strs = _params(service, prompt, num_samples, params, decode)
    seed = params.get("seed")
    gens = [torch.Generator().manual_seed(seed + i) if seed is not None else None
            for i in range(num_samples)]
    adapter = service._sampler(path)
    model = service.model
    seqs = [Sequence_([], [], "length") for _ in range(num_samples)]
    alive = list(range(num_samples))
    with service.lora.active(adapter):
        cache = DynamicCache(config=model.config)  # filled in place by each forward
        out = model(input_ids=torch.tensor([prompt] * num_samples), cache=cache, use_cache=True,
                    logits_to_keep=0 if prompt_logprobs else 1)
        first = out.logits[0].float().log_softmax(-1) if prompt_logprobs else None
        logits = out.logits[:, -1]
        for _ in range(sp.max_tokens):
            tokens, lps = sample_tokens(logits, [sp] * num_samples, gens)
            for i in list(alive):
                seq, tok = seqs[i], int(tokens[i])
                seq.tokens.append(tok)
                seq.logprobs.append(float(lps[i]))
                if tok in stop_ids or (stop_strs and any(
                        s in decode(seq.tokens) for s in stop_strs)):
                    seq.stop_reason = "stop"
                    alive.remove(i)
            if not alive:
                break
            out = model(input_ids=tokens.unsqueeze(-1), cache=cache, use_cache=True)
            logits = out.logits[:, -1]
    lp = None
    if first is not None:
        lp = np.full(len(prompt), np.nan, dtype=np.float32)
        lp[1:] = first[:-1].gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1)
    return seqs, lp


class EngineSampler:
    """Sampling through a `LocalEngine` (forgerl/engines/local): each sampler snapshot is loaded
    as an engine adapter (version 1; past SAMPLER_SLOTS the oldest idle one is removed, never one
    a request samples from), and
    the `num_samples` rows of every request join the engine's continuous batch, beside the rows
    of other samplers and adapters (per-row LoRA, grouped matmuls). No prompt logprobs (those
    requests go to `sample`)."""

    def __init__(self, service: TinkerService, engine: Any) -> None:
        self.service, self.engine = service, engine
        self._loads: OrderedDict[str, asyncio.Task[str]] = OrderedDict()  # snapshot → adapter
        self._ids = itertools.count()
        self._users: Counter[str | None] = Counter()  # snapshot → requests sampling from it

    async def _adapter(self, path: str, key: str) -> str:
        if key not in self._loads:
            folder = self.service.folder(path)
            idle = [k for k in self._loads if not self._users[k]]  # one in use stays loaded
            if len(self._loads) >= SAMPLER_SLOTS and idle:
                await self.engine.remove_adapter(await self._loads.pop(idle[0]))
            alpha = json.loads((folder / "adapter_config.json").read_text())["lora_alpha"]
            tensors = load_file(str(folder / "adapter_model.safetensors"))
            name = f"sampler{next(self._ids)}-{path}"
            self._loads[key] = asyncio.ensure_future(self._load(name, tensors, alpha))
        self._loads.move_to_end(key)
        return await self._loads[key]

    async def _load(self, name: str, tensors: dict, alpha: float) -> str:
        await self.engine.load_adapter(name, tensors, 1, alpha)
        return name

    async def sample(self, path: str | None, prompt: list[int], num_samples: int, params: dict,
                     decode: Callable[[list[int]], str] | None = None) -> list[Sequence_]:
        """As `sample` (no prompt logprobs); stop strings cut the completion after sampling."""
        sp, stop_ids, stop_strs = _params(self.service, prompt, num_samples, params, decode)
        key = None if path is None else self.service.snapshot(path)  # re-saved: new (C23)
        self._users[key] += 1  # before any await: no other request evicts it meanwhile
        try:
            adapter = None if path is None or key is None else await self._adapter(path, key)
            seed = params.get("seed")
            outs = await asyncio.gather(*(self.engine.generate(prompt, replace(
                sp, stop_token_ids=tuple(sorted(stop_ids)),
                seed=None if seed is None else seed + i), adapter=adapter)
                for i in range(num_samples)))
        finally:
            self._users[key] -= 1
        return [_cut(Sequence_(o.completion_ids, o.logprobs,
                               "stop" if o.finish_reason == "stop" else "length"),
                     stop_strs, decode) for o in outs]
