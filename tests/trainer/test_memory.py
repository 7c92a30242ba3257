"""Memory-bounded training on the tiny model (issue 14 items 1-3).

Pins: chunked logprobs (`forward_logprobs` with chunk_tokens > 0: decoder hidden states, then
lm_head + logit transform + log_softmax per chunk under checkpoint) equal the model's own
forward path in values (< 1e-5, fp32) and in parameter gradients (< 1e-5), with chunks that do
not divide the predictions, shared nodes predicted by several samples and mixed temperatures;
so do the families whose forward transforms logits (Cohere logit_scale, Granite
logits_scaling, Gemma2 soft-capping); a family with a transform the chunked head does not
know is detected and the trainer falls back to the unchunked path. Activation checkpointing
(full, selective) gives the same gradients as off (< 1e-6) and saves fewer activations. A
trajectory whose tree is split across rows (each piece with its ancestors) gives the same
loss and gradients as one row; a turn larger than max_row_tokens is a one-line ValueError
naming both sizes.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from forgerl.models import build_tiny_model
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.trainer import Trainer
from forgerl.trainer.tree_forward import forward_logprobs, supports_chunked_logprobs
from forgerl.types import Completion, Group, SamplingParams, Trajectory


def _row_sequences(vocab: int = 259) -> tuple[list[list[int]], list[list[float]]]:
    """Three branching sequences (shared 10- and 20-token prefixes), two temperatures."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 30, 25)]
    seqs[1][:10] = seqs[0][:10]
    seqs[2][:20] = seqs[0][:20]
    temps = [[0.7] * len(seqs[0]), [0.7] * len(seqs[1]), [1.0] * len(seqs[2])]
    return seqs, temps


def _logprobs_and_grads(model, row, chunk):
    model.zero_grad(set_to_none=True)
    logprobs = forward_logprobs(model, row, chunk)  # (K,)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel())
    (weights * logprobs).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _max_grad_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_logprobs_and_gradients_equal_unchunked(tiny_model, chunk):
    model = tiny_model.train()
    seqs, temps = _row_sequences()
    needed = [[True] * len(s) for s in seqs]
    (row,) = build_tree_batch(seqs, 128, needed=needed, temperatures=temps).rows
    assert row.pred_pos.unique().numel() < row.pred_pos.numel()  # shared nodes, several samples
    plain, plain_grads = _logprobs_and_grads(model, row, 0)
    chunked, chunked_grads = _logprobs_and_grads(model, row, chunk)
    assert (plain - chunked).abs().max().item() < 1e-5
    assert _max_grad_diff(plain_grads, chunked_grads) < 1e-5
    assert plain_grads["model.embed_tokens.weight"].abs().sum() > 0  # the tied head has a grad


DIMS = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TRANSFORMS = {  # families whose forward transforms the logits after the lm_head
    "cohere": (tf.CohereConfig, {"logit_scale": 0.25, "pad_token_id": 0}),
    "granite": (tf.GraniteConfig, {"logits_scaling": 4.0}),
    "gemma2": (tf.Gemma2Config, {"head_dim": 8, "final_logit_softcapping": 2.0}),
}


def _family(config_class, overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_class(**DIMS, **overrides)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # spread logits, so a missed transform shows
    return model


@pytest.mark.parametrize("family", sorted(TRANSFORMS))
def test_chunked_logprobs_keep_the_familys_logit_transform(family):
    model = _family(*TRANSFORMS[family])
    assert supports_chunked_logprobs(model)
    seqs, temps = _row_sequences(DIMS["vocab_size"])
    (row,) = build_tree_batch(seqs, 128, temperatures=temps).rows
    plain, plain_grads = _logprobs_and_grads(model.train(), row, 0)
    chunked, chunked_grads = _logprobs_and_grads(model, row, 16)
    assert (plain - chunked).abs().max().item() < 1e-5
    assert _max_grad_diff(plain_grads, chunked_grads) < 1e-5


class _BiasedLlama(tf.LlamaForCausalLM):
    """A family whose forward adds a per-token logit bias the chunked head cannot know."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=use_cache,
                              logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits + torch.arange(out.logits.shape[-1], dtype=out.logits.dtype)
        return out


def test_unknown_logit_transform_falls_back_to_the_models_forward():
    torch.manual_seed(0)
    model = _BiasedLlama(build_tiny_model().config)
    assert not supports_chunked_logprobs(model)
    trainer = Trainer(model, device="cpu", logprob_chunk_tokens=64)
    assert trainer.logprob_chunk_tokens == 0  # the forward's own logits, as before
    assert Trainer(build_tiny_model(), device="cpu", logprob_chunk_tokens=64).logprob_chunk_tokens


def _completion(prompt: list[int], completion: list[int]) -> Completion:
    return Completion(prompt, completion, [-1.0 - 0.01 * i for i in range(len(completion))],
                      [0] * len(completion), 0, "stop", sampling=SamplingParams(temperature=0.8))


def _long_group() -> Group:
    """One long trajectory that rewrites its context twice (3 samples sharing a 24-token
    prefix, each under 64 tokens, about 150 tree tokens) and a short rival for the baseline."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 259, (n,), generator=g).tolist()

    shared = ids(24)
    turn1 = _completion(shared + ids(8), ids(20))
    turn2 = _completion(shared + ids(6), ids(16))
    turn3 = _completion([*turn2.prompt_ids, *turn2.completion_ids, *ids(4)], ids(12))
    turn4 = _completion(shared + ids(6), ids(25))
    long = Trajectory("long", 0, 0, [turn1, turn2, turn3, turn4], reward=1.0, status="finished")
    short = Trajectory("short", 0, 1, [_completion(shared, ids(5))], reward=0.0,
                       status="finished")
    return Group(0, [long, short])


def _step_gradients(trainer: Trainer, groups: list[Group]) -> tuple[float, int, dict]:
    batch = trainer.prepare(groups)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = trainer.accumulate_gradients(batch)["loss"]
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return loss, len(batch.tree.rows), grads


def test_long_trajectory_split_across_rows_equals_one_row():
    groups = [_long_group()]
    one_loss, one_rows, one_grads = _step_gradients(
        Trainer(build_tiny_model(), device="cpu", max_row_tokens=512), groups)
    split_loss, split_rows, split_grads = _step_gradients(
        Trainer(build_tiny_model(), device="cpu", max_row_tokens=64), groups)
    assert (one_rows, split_rows) == (1, 3)
    assert abs(one_loss - split_loss) < 1e-6 and one_loss != 0.0
    assert _max_grad_diff(one_grads, split_grads) < 1e-6


def test_turn_larger_than_the_row_budget_is_a_one_line_error():
    big = Trajectory("big", 0, 0, [_completion(list(range(3, 60)), [70, 71, 72, 73])],
                     reward=1.0, status="finished")
    small = Trajectory("small", 0, 1, [_completion([3, 4, 5], [6])], reward=0.0,
                       status="finished")
    trainer = Trainer(build_tiny_model(), device="cpu", max_row_tokens=32)
    with pytest.raises(ValueError) as info:
        trainer.train_step([Group(0, [big, small])])
    message = str(info.value)
    assert "\n" not in message
    assert message == ("trajectory big: a turn of 61 tokens (prompt + completion) exceeds "
                       "trainer.max_row_tokens (32)")
    assert trainer.step == 0


def _saved_bytes_and_gradients(trainer: Trainer, groups: list[Group]) -> tuple[int, dict]:
    """Bytes autograd saves for the backward over one step's forwards, and the gradients."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    batch = trainer.prepare(groups)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.accumulate_gradients(batch)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return saved, grads


def test_activation_checkpointing_gives_exact_gradients_and_saves_less():
    groups = [_long_group()]
    results = {}
    for mode in ("off", "selective", "full"):
        trainer = Trainer(build_tiny_model(), device="cpu", activation_checkpointing=mode,
                          checkpoint_every_layers=2, logprob_chunk_tokens=16)
        results[mode] = _saved_bytes_and_gradients(trainer, groups)
    (off_saved, off_grads) = results["off"]
    for mode in ("selective", "full"):
        assert _max_grad_diff(off_grads, results[mode][1]) < 1e-6
    assert off_saved > results["selective"][0] > results["full"][0]
    with pytest.raises(ValueError, match="must be off, full or selective"):
        Trainer(build_tiny_model(), device="cpu", activation_checkpointing="some")


@pytest.mark.smollm2
def test_smollm2_keeps_chunked_logprobs():
    """The main job's model: its chunked and plain logprobs differ by float rounding only
    (1.05e-5 at 21 nats), which must not switch chunking off (it did under an absolute 1e-5)."""
    from forgerl.models import load_pretrained

    model, _ = load_pretrained("smollm2")
    assert supports_chunked_logprobs(model)
    assert Trainer(model, device="cpu", logprob_chunk_tokens=256).logprob_chunk_tokens == 256


def test_bf16_autocast_keeps_fp32_state_and_close_gradients():
    """trainer.autocast = "bfloat16": the forwards run in bf16, but parameters and gradients
    stay fp32 and the gradients are those of fp32 up to bf16 rounding (relative to their size);
    the saved activations are smaller."""
    groups = [_long_group()]
    results = {}
    for mode in ("off", "bfloat16"):
        trainer = Trainer(build_tiny_model(), device="cpu", autocast=mode, logprob_chunk_tokens=16)
        assert trainer.autocast_dtype == (None if mode == "off" else torch.bfloat16)
        results[mode] = _saved_bytes_and_gradients(trainer, groups)
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    (saved32, g32), (saved16, g16) = results["off"], results["bfloat16"]
    assert all(g.dtype == torch.float32 for g in g16.values())
    scale = max(g.abs().max().item() for g in g32.values())
    assert 0 < _max_grad_diff(g32, g16) < 0.05 * scale  # bf16 keeps 8 mantissa bits
    assert saved16 < 0.8 * saved32


def test_engine_dtype_auto_follows_the_hardware(monkeypatch):
    from forgerl.models import engine_dtype

    cpu = torch.device("cpu")
    assert engine_dtype("float32", cpu) == torch.float32
    assert engine_dtype("bfloat16", cpu) == torch.bfloat16
    for amx, avx512_bf16, want in [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                   (False, False, torch.float32)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda a=amx: a, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda b=avx512_bf16: b,
                            raising=False)
        assert engine_dtype("auto", cpu) == want, (amx, avx512_bf16)
    assert Trainer(build_tiny_model(), device="cpu", autocast="auto").autocast_dtype is None
