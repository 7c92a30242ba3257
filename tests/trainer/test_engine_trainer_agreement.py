"""Behavior logprobs from the rollout engine equal the trainer's policy logprobs on the same
weights (fp32, max abs diff < 1e-4), so the CISPO ratio starts at exactly 1 (CASES.md C04): the
engine records log_softmax(logits / T) of the distribution it sampled, and the trainer's
prefix-tree forward recomputes the same quantity for several samples that share a prompt."""

from __future__ import annotations

import asyncio

import torch

from forgerl.engines.local import LocalEngine
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.tree_forward import forward_logprobs
from forgerl.types import SamplingParams


async def _generate(model, prompt, temperature, n, dtype=None):
    engine = LocalEngine(model, max_model_len=512, max_batch_size=8, dtype=dtype)
    assert engine.weight_dtype == (dtype or torch.float32)
    try:
        params = [SamplingParams(temperature=temperature, max_tokens=24, seed=s) for s in range(n)]
        return await asyncio.gather(*(engine.generate(prompt, p) for p in params))
    finally:
        await engine.close()


def _diffs(model, tokenizer, dtype=None) -> list[float]:
    """|behavior - trainer| logprob of every sampled token of 4 seeded rollouts; the trainer
    forwards under autocast in `dtype` (None: fp32)."""
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    temperature = 0.8
    outs = asyncio.run(_generate(model, prompt, temperature, n=4, dtype=dtype))
    sequences = [prompt + o.completion_ids for o in outs]
    needed = [[t >= len(prompt) for t in range(len(s))] for s in sequences]
    temps = [[temperature] * len(s) for s in sequences]
    tree = build_tree_batch(sequences, max_row_tokens=1024, needed=needed, temperatures=temps)
    assert tree.num_tree_tokens < tree.num_input_tokens  # the shared prompt is merged
    trainer_lp = {}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=dtype is not None):
        for row in tree.rows:
            lp = forward_logprobs(model, row)
            for s, t, value in zip(row.sample_idx.tolist(), row.token_idx.tolist(), lp.tolist(),
                                   strict=True):
                trainer_lp[s, t] = value
    diffs = []
    for s, out in enumerate(outs):
        assert len(out.completion_ids) == len(out.logprobs) > 0
        for j, behavior in enumerate(out.logprobs):
            diffs.append(abs(trainer_lp[s, len(prompt) + j] - behavior))
    return diffs


def test_engine_logprobs_equal_trainer_logprobs(tiny_model, tokenizer):
    diffs = _diffs(tiny_model, tokenizer)
    assert max(diffs) < 1e-4
    ratios = torch.exp(-torch.tensor(diffs))
    assert torch.allclose(ratios, torch.ones_like(ratios), atol=1e-4)


def test_bf16_engine_logprobs_near_bf16_trainer_logprobs(tiny_model, tokenizer):
    """A bf16 engine (`[engine] dtype`) against the trainer under bf16 autocast: the same
    quantity up to bf16 rounding (CISPO's ratio absorbs it), recorded as float32; the caller's
    model stays fp32."""
    diffs = _diffs(tiny_model, tokenizer, torch.bfloat16)
    assert next(tiny_model.parameters()).dtype == torch.float32
    assert 0 < sum(diffs) / len(diffs) < 0.005 and max(diffs) < 0.05  # measured 0.0009, 0.0048
