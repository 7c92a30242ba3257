"""Prefix-tree merging: merged rows give the per-sample logprobs, loss and gradients.

Pins the semantics of `forgerl.trainer.prefix_tree` and `forgerl.trainer.attention`:
- CASES.md C11 in our words: two packed samples never see each other; targets stop at each
  sample's end, position ids restart at 0, and the first sample's logprobs do not depend on
  where (or whether) the second one sits in the row, nor on its tokens.
- For a group sharing a prompt, turns extending each other, a rewritten (branched) context,
  unrelated sequences and a tree split across rows, every per-token logprob and every
  parameter gradient of a weighted loss equals the per-sequence computation on the tiny model.
- Structure invariants on random sequence sets (hypothesis, no model): every needed (s, t)
  appears once, the ancestor path of its prediction position spells s[:t], positions are
  depths, and the interval-built ancestor mask equals the parent-chain definition.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forgerl.trainer.attention import ancestor_mask, tree_attention_mask
from forgerl.trainer.prefix_tree import TreeBatch, build_tree_batch
from forgerl.trainer.tree_forward import forward_logprobs

IGNORE = -100


def alone_logprobs(model, seq: list[int]) -> torch.Tensor:
    """(L-1,) logprobs of seq[1:] with the sequence run alone through the plain HF forward."""
    logits = model(torch.tensor(seq)[None]).logits[0].float()  # (L, V)
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def tree_logprobs(model, batch: TreeBatch) -> dict[tuple[int, int], torch.Tensor]:
    """(s, t) -> scalar logprob from the merged rows (graph kept)."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    for row in batch.rows:
        lp = forward_logprobs(model, row)
        for k, (s, t) in enumerate(
            zip(row.sample_idx.tolist(), row.token_idx.tolist(), strict=True)
        ):
            assert (s, t) not in out
            out[(s, t)] = lp[k]
    return out


def row_targets(batch: TreeBatch, r: int) -> list[int]:
    row = batch.rows[r]
    targets = torch.full_like(row.input_ids, IGNORE)
    targets[row.pred_pos] = row.target_ids
    return targets.tolist()


# ---- C11: packing without merging ---------------------------------------------------------

A, B = [10, 11, 12], [20, 21]


def test_c11_packed_targets_and_positions():
    batch = build_tree_batch([A, B], max_row_tokens=8, merge=False)
    assert len(batch.rows) == 1
    row = batch.rows[0]
    assert row.input_ids.tolist() == [10, 11, 12, 20, 21]
    assert row_targets(batch, 0) == [11, 12, IGNORE, 21, IGNORE]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert row.parent.tolist() == [-1, 0, 1, -1, 3]
    assert row.sample_idx.tolist() == [0, 0, 1]
    assert row.token_idx.tolist() == [1, 2, 1]
    assert batch.num_input_tokens == batch.num_tree_tokens == 5


def _sample_logprobs(model, sequences: list[list[int]], s: int, merge: bool) -> torch.Tensor:
    lps = tree_logprobs(model, build_tree_batch(sequences, 16, merge=merge))
    return torch.stack([lps[(s, t)] for t in range(1, len(sequences[s]))])


@torch.no_grad()
def test_c11_sample_independent_of_neighbour(tiny_model):
    ref = alone_logprobs(tiny_model, A)
    alone = _sample_logprobs(tiny_model, [A], 0, merge=False)
    before = _sample_logprobs(tiny_model, [A, B], 0, merge=False)
    after = _sample_logprobs(tiny_model, [B, A], 1, merge=False)
    other_b = _sample_logprobs(tiny_model, [[30, 31, 32, 33], A], 1, merge=False)
    # merged: B branches off A after its first token; A must still be unchanged
    branch = _sample_logprobs(tiny_model, [A, [10, 99, 98, 97]], 0, merge=True)
    # packed vs alone forwards add in other orders: 1e-5 (~20 ulps at |logprob| ~ 5.5), as below
    for got in (alone, before, after, other_b, branch):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert build_tree_batch([[30, 31, 32, 33], A], 16).rows[0].input_ids.tolist()[4:] == A


# ---- scenarios: merged == per-sequence, values and gradients -------------------------------


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def _scenario(name: str) -> tuple[list[list[int]], int]:
    """(sequences, max_row_tokens) for one workload shape."""
    rng = random.Random(name)
    prompt = _rand(rng, 12)
    if name == "group":  # G = 4 completions of one prompt
        return [prompt + _rand(rng, n) for n in (5, 7, 6, 8)], 64
    if name == "multi_turn":  # each turn's prompt extends the previous turn
        t1 = prompt + _rand(rng, 5)
        t2 = t1 + _rand(rng, 6)
        return [t1, t2, t2 + _rand(rng, 4)], 64
    if name == "rewrite":  # context rewritten after turn 1: new prompt branches from the old
        t1 = prompt + _rand(rng, 5)
        return [t1 + _rand(rng, 7), t1 + _rand(rng, 3) + _rand(rng, 6), [*t1, 7]], 64
    if name == "unrelated":
        return [[3 + i, *_rand(rng, 6 + i)] for i in range(3)], 64
    if name == "split":  # 12 + 8 tokens per path, rows of 32: ancestors repeated across rows
        return [prompt + _rand(rng, 8) for _ in range(4)] + [prompt[:5] + _rand(rng, 4)], 32
    raise KeyError(name)


SCENARIOS = ["group", "multi_turn", "rewrite", "unrelated", "split"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_merged_equals_per_sequence(tiny_model, name):
    sequences, cap = _scenario(name)
    batch = build_tree_batch(sequences, cap)
    if name == "unrelated":
        assert batch.num_tree_tokens == batch.num_input_tokens
    else:
        assert batch.num_tree_tokens < batch.num_input_tokens
    if name == "split":
        assert len(batch.rows) > 1
        assert any(row.input_ids[0] == sequences[0][0] for row in batch.rows[1:])  # repeated root
    assert all(row.input_ids.numel() <= cap for row in batch.rows)

    rng = torch.Generator().manual_seed(0)
    weights = [torch.rand(len(s) - 1, generator=rng) * 2 - 1 for s in sequences]
    lps = tree_logprobs(tiny_model, batch)
    assert sorted(lps) == sorted((s, t) for s, q in enumerate(sequences) for t in range(1, len(q)))
    loss_tree = sum(w * lps[(s, t)] for s, ws in enumerate(weights) for t, w in enumerate(ws, 1))
    loss_tree.backward()
    grads_tree = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()

    loss_ref = 0.0
    for s, seq in enumerate(sequences):
        ref = alone_logprobs(tiny_model, seq)
        got = torch.stack([lps[(s, t)] for t in range(1, len(seq))])
        assert (got.detach() - ref.detach()).abs().max() < 1e-5
        loss_ref = loss_ref + (weights[s] * ref).sum()
    loss_ref.backward()
    assert abs(loss_tree.item() - loss_ref.item()) < 1e-5
    for n, p in tiny_model.named_parameters():
        assert p.grad.abs().max() > 0, n
        assert (grads_tree[n] - p.grad).abs().max() < 1e-5, n


@torch.no_grad()
def test_eager_attention_uses_float_mask(tiny_model):
    sequences, cap = _scenario("rewrite")
    tiny_model.config._attn_implementation = "eager"
    batch = build_tree_batch(sequences, cap)
    mask = tree_attention_mask(tiny_model, batch.rows[0])
    assert mask.dtype == torch.float32 and mask.shape[:2] == (1, 1)
    lps = tree_logprobs(tiny_model, batch)
    for s, seq in enumerate(sequences):
        got = torch.stack([lps[(s, t)] for t in range(1, len(seq))])
        assert (got - alone_logprobs(tiny_model, seq)).abs().max() < 1e-5


def test_needed_selects_predictions_once():
    sequences, _ = _scenario("group")
    needed = [[t >= 12 for t in range(len(s))] for s in sequences]  # completion tokens only
    batch = build_tree_batch(sequences, 64, needed=needed)
    pairs = [
        (s, t)
        for row in batch.rows
        for s, t in zip(row.sample_idx.tolist(), row.token_idx.tolist(), strict=True)
    ]
    assert sorted(pairs) == [(s, t) for s, q in enumerate(sequences) for t in range(12, len(q))]
    # the tree: 12 shared prompt tokens + 5 + 7 + 6 + 8 completion tokens
    assert batch.num_tree_tokens == 38 and batch.num_input_tokens == 4 * 12 + 26


def test_prefix_sequence_shares_all_nodes():
    batch = build_tree_batch([[5, 6, 7], [5, 6, 7, 8, 9], [5, 6]], 16)
    row = batch.rows[0]
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4]
    assert batch.num_tree_tokens == 5 and batch.num_input_tokens == 10
    # (s, t) -> pred_pos: t - 1 for each, since all sequences are one path
    assert row.pred_pos.tolist() == [0, 1, 0, 1, 2, 3, 0]
    assert row.target_ids.tolist() == [6, 7, 6, 7, 8, 9, 6]


def test_deep_shared_prompt_split_across_rows():
    # a 1500-token shared prompt is a chain deeper than Python's recursion limit
    prompt = [3 + i % 250 for i in range(1500)]
    sequences = [prompt + [c] * 300 for c in (7, 8, 9)] + [prompt[:10]]
    batch = build_tree_batch(sequences, 2000)
    assert [row.input_ids.numel() for row in batch.rows] == [1800, 1800, 1800]
    assert batch.num_tree_tokens == 5400 and batch.num_input_tokens == 3 * 1800 + 10
    for row, c in zip(batch.rows, (7, 8, 9), strict=True):
        assert row.input_ids.tolist() == prompt + [c] * 300
        assert row.position_ids.tolist() == list(range(1800))
    owned = [row.sample_idx.tolist() for row in batch.rows]
    # the prompt's nodes (predicting t = 1..1500 of every sequence) are owned by row 0 only;
    # the repeated copies in rows 1 and 2 predict nothing
    assert [owned[0].count(s) for s in range(4)] == [1799, 1500, 1500, 9]
    assert owned[1] == [1] * 299 and owned[2] == [2] * 299
    assert batch.rows[1].pred_pos.min() == 1500


def test_too_long_sequence_names_both_numbers():
    with pytest.raises(ValueError, match=r"7 tokens.*max_row_tokens=6"):
        build_tree_batch([[1, 2], [1, 2, 3, 4, 5, 6, 7]], max_row_tokens=6)


# ---- structure invariants on random sequence sets ------------------------------------------


@st.composite
def tree_inputs(draw):
    seqs = draw(
        st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=7)
    )
    needed = [draw(st.lists(st.booleans(), min_size=len(s), max_size=len(s))) for s in seqs]
    cap = max(len(s) for s in seqs) + draw(st.integers(0, 8))
    return seqs, needed, cap, draw(st.booleans())


@settings(max_examples=25, deadline=None)
@given(tree_inputs())
def test_structure_invariants(args):
    seqs, needed, cap, merge = args
    batch = build_tree_batch(seqs, cap, needed=needed, merge=merge)
    seen = []
    for row in batch.rows:
        n = row.input_ids.numel()
        assert 0 < n <= cap
        parent = row.parent.tolist()
        pos = row.position_ids.tolist()
        for i, p in enumerate(parent):
            assert p < i and pos[i] == (0 if p < 0 else pos[p] + 1)
        brute = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                brute[i, j] = True
                j = parent[j]
        assert torch.equal(ancestor_mask(row.parent), brute)
        ids = row.input_ids.tolist()
        for k, (s, t) in enumerate(
            zip(row.sample_idx.tolist(), row.token_idx.tolist(), strict=True)
        ):
            path, j = [], row.pred_pos[k].item()
            while j >= 0:
                path.append(ids[j])
                j = parent[j]
            assert path[::-1] == seqs[s][:t]
            assert row.target_ids[k].item() == seqs[s][t]
            seen.append((s, t))
    assert sorted(seen) == [(s, t) for s, m in enumerate(needed) for t in range(1, len(m)) if m[t]]
    assert batch.num_input_tokens == sum(map(len, seqs))
    assert batch.num_tree_tokens == sum(r.input_ids.numel() for r in batch.rows)
    if not merge:
        assert batch.num_tree_tokens == batch.num_input_tokens
    else:
        assert batch.num_tree_tokens <= batch.num_input_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_attention_block_mask_matches_alone():
    from forgerl.models import build_tiny_model

    model = build_tiny_model().cuda()
    model.config._attn_implementation = "flex_attention"
    sequences, cap = _scenario("split")
    lps = tree_logprobs(model, build_tree_batch(sequences, cap))
    model.config._attn_implementation = "sdpa"
    for s, seq in enumerate(sequences):
        got = torch.stack([lps[(s, t)] for t in range(1, len(seq))])
        ref = alone_logprobs(model, seq).to(got.device)
        assert (got - ref).abs().max() < 1e-4
