"""Sampling for the Tinker API: `num_samples` completions of one prompt under one adapter.

The rows share the prompt, so they are prefilled as one unpadded batch and decoded together over
a KV cache (transformers' own cache), each row with its own generator (seed + row index when the
request has a seed); tokens and their logprobs come from the local engine's sampler
(`forgerl.engines.local.sampler.sample_tokens`: temperature, top_p, top_k with vLLM's
conventions; the logprob is that of the distribution sampled from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from forgerl.engines.local.sampler import sample_tokens
from forgerl.tinker.service import TinkerError, TinkerService
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


@torch.no_grad()
def sample(service: TinkerService, path: str | None, prompt: list[int], num_samples: int,
           params: dict, decode=None, prompt_logprobs: bool = False
           ) -> tuple[list[Sequence_], np.ndarray | None]:
    """Sample `num_samples` completions of `prompt` from the sampler snapshot at `path` (None:
    the base model). params: Tinker's SamplingParams as a dict (max_tokens, temperature, top_p,
    top_k, seed, stop). decode: ids → text, needed for stop strings. Returns the sequences and,
    with `prompt_logprobs`, the prompt's logprobs (len(prompt),) float32 with NaN first."""
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
    seed = params.get("seed")
    gens = [torch.Generator().manual_seed(seed + i) if seed is not None else None
            for i in range(num_samples)]
    adapter = service._sampler(path)
    service.check_ids(prompt)
    model = service.model
    seqs = [Sequence_([], [], "length") for _ in range(num_samples)]
    alive = list(range(num_samples))
    with service.lora.active(adapter):
        cache = DynamicCache(config=model.config)  # filled in place by each forward
        out = model(input_ids=torch.tensor([prompt] * num_samples), cache=cache, use_cache=True,
                    logits_to_keep=0 if prompt_logprobs else 1)
        first = out.logits[0].float().log_softmax(-1) if prompt_logprobs else None
        logits = out.logits[:, -1]
        for _ in range(max_tokens):
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
