"""Block-sparse tree attention (`attention.tree_sdpa`): the same logprobs and gradients as the
dense tree mask, while each query block only gathers the keys its subtrees can see (CASES.md
C11 under the trainer's attention: a token never attends to another branch)."""

from __future__ import annotations

import random

import pytest
import torch

from forgerl.models import build_tiny_model
from forgerl.trainer import attention
from forgerl.trainer.attention import TREE_SDPA, attn_implementation, tree_blocks
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.tree_forward import forward_logprobs


def _tree_row():
    """One row: a shared 12-token prompt, two tasks, each with 3 completions of 2..30 tokens,
    and one completion that branches again after 5 tokens (a second turn)."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 250) for _ in range(12)]
    seqs = []
    for task in range(2):
        base = prompt + [rng.randrange(3, 250) for _ in range(4 + task)]
        for _ in range(3):
            seqs.append(base + [rng.randrange(3, 250) for _ in range(rng.randrange(2, 31))])
        turn = base + [rng.randrange(3, 250) for _ in range(5)]
        seqs += [turn + [rng.randrange(3, 250) for _ in range(n)] for n in (3, 9)]
    (row,) = build_tree_batch(seqs, 512).rows
    return row


def _logprobs_and_grads(model, row, impl):
    model.zero_grad(set_to_none=True)
    with attn_implementation(model, impl):
        logprobs = forward_logprobs(model, row)
        (logprobs * torch.linspace(-1, 1, len(logprobs))).sum().backward()
    return logprobs.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("block", [1, 7, 16, 512])
def test_block_sparse_tree_attention_equals_the_dense_mask(monkeypatch, block):
    monkeypatch.setattr(attention, "TREE_BLOCK_TOKENS", block)
    model, row = build_tiny_model(seed=1).train(), _tree_row()
    assert len(row.input_ids) > 100
    dense, dense_grads = _logprobs_and_grads(model, row, "sdpa")
    sparse, sparse_grads = _logprobs_and_grads(model, row, TREE_SDPA)
    assert (dense - sparse).abs().max() < 1e-5
    for a, b in zip(dense_grads, sparse_grads, strict=True):
        assert (a - b).abs().max() < 1e-5 * max(1.0, a.abs().max().item())


def test_a_branch_block_gathers_its_ancestors_but_not_its_siblings():
    # 0 -> 1 -> {2 -> 3, 4 -> 5 -> 6}: DFS order; blocks of 2 tokens
    parent = torch.tensor([-1, 0, 1, 2, 1, 4, 5])
    mask = tree_blocks(parent, torch.float32, torch.device("cpu"), block=2)
    assert mask.shape == (1, 1, 7, 7) and mask.untyped_storage().nbytes() == 4  # placeholder
    keys = [(a, b, k.tolist()) for a, b, k, _ in mask.blocks]
    assert keys == [(0, 2, [0, 1]), (2, 4, [0, 1, 2, 3]), (4, 6, [0, 1, 4, 5]),
                    (6, 7, [0, 1, 4, 5, 6])]
    allowed = mask.blocks[2][3] == 0  # queries 4 and 5 over keys 0, 1, 4, 5
    assert allowed.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_other_masks_go_to_plain_sdpa_and_a_stripped_placeholder_is_refused():
    model = build_tiny_model(seed=1).eval()
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with attn_implementation(model, TREE_SDPA):  # no mask: causal, as sdpa
            assert torch.allclose(model(input_ids=ids).logits, plain, atol=1e-6)
    stripped = tree_blocks(torch.tensor([-1, 0]), torch.float32, torch.device("cpu"))[..., :1, :]
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="without its blocks"):
        attention.tree_sdpa(model, q, q, q, stripped)
    blocks = tree_blocks(torch.tensor([-1]), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="no soft-cap"):  # Gemma2's would be silently dropped
        attention.tree_sdpa(model, q, q, q, blocks, softcap=50.0)
