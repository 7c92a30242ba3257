"""Trainer logprobs come from each family's own forward (issue 9, defect 3 of the issue).

Pins: for every supported family, built in code from a tiny transformers config with random
weights (std 0.5, so logits spread), the trainer accepts the model and its prefix-tree
logprobs equal log_softmax of the model's own plain forward within 1e-5 (fp32), including the
families whose forward post-processes logits (Cohere / Cohere2 `logit_scale`, Granite
`logits_scaling`, Gemma2 / Gemma3 `final_logit_softcapping`); for those, the raw
decoder + output-embedding logits the trainer used to take differ by more than 0.1, so the
test would see the defect. Families the tree cannot serve are refused when the Trainer is
built, with one line naming the reason: no `logits_to_keep` (xLSTM), recurrent layers (Mamba,
FalconH1 hybrid), a sliding window smaller than a row (Mistral), ALiBi positions that ignore
position ids (MPT: the probe sees the difference; Bloom: its forward fails on a tree mask).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from forgerl.trainer.attention import tree_attention_mask
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.trainer import Trainer
from forgerl.trainer.tree_forward import forward_logprobs

DIMS = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SUPPORTED = {  # name: (config class, overrides, whether the forward transforms the logits)
    "llama": (tf.LlamaConfig, {}, False),
    "qwen2": (tf.Qwen2Config, {}, False),
    "qwen3": (tf.Qwen3Config, {"head_dim": 8}, False),
    "mistral": (tf.MistralConfig, {}, False),  # sliding window 4096 >= max_row_tokens
    "phi3": (tf.Phi3Config, {"pad_token_id": 0}, False),
    "gemma": (tf.GemmaConfig, {"head_dim": 8}, False),  # scales embeddings inside the decoder
    "cohere": (tf.CohereConfig, {"logit_scale": 0.25, "pad_token_id": 0}, True),
    "cohere2": (tf.Cohere2Config, {"logit_scale": 0.25, "pad_token_id": 0}, True),
    "granite": (tf.GraniteConfig, {"logits_scaling": 4.0}, True),
    "gemma2": (tf.Gemma2Config, {"head_dim": 8, "final_logit_softcapping": 2.0}, True),  # eager
    "gemma3": (tf.Gemma3TextConfig, {"head_dim": 8, "final_logit_softcapping": 2.0}, True),
}
SEQUENCES = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23, 24], [5, 6, 7, 30, 31]]


def _build(config_class, overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    config = config_class(**overrides)
    model = tf.AutoModelForCausalLM.from_config(config).float()  # sdpa, or eager without it
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def _tree_and_raw(model) -> tuple[dict, dict]:
    """(s, t) → trainer logprob, and → the old raw-logits logprob (decoder + output embedding)."""
    tree, raw = {}, {}
    for row in build_tree_batch(SEQUENCES, 64).rows:
        keys = list(zip(row.sample_idx.tolist(), row.token_idx.tolist(), strict=True))
        tree.update(zip(keys, forward_logprobs(model, row).tolist(), strict=True))
        hidden = model.get_decoder()(
            input_ids=row.input_ids[None],
            position_ids=row.position_ids[None],
            attention_mask=tree_attention_mask(model, row),
            use_cache=False,
        ).last_hidden_state[0]  # (N, H)
        logits = model.get_output_embeddings()(hidden[row.pred_pos]).float()  # (K, V)
        picked = torch.log_softmax(logits, -1)[torch.arange(len(keys)), row.target_ids]
        raw.update(zip(keys, picked.tolist(), strict=True))
    return tree, raw


@pytest.mark.parametrize("family", sorted(SUPPORTED))
@torch.no_grad()
def test_trainer_logprobs_equal_the_models_own_forward(family):
    config_class, overrides, transforms = SUPPORTED[family]
    model = _build(config_class, {**DIMS, **overrides})
    trainer = Trainer(model, max_row_tokens=64, device="cpu")  # passes check_tree_support
    tree, raw = _tree_and_raw(trainer.model.eval())
    tree_diff = raw_diff = 0.0
    for s, seq in enumerate(SEQUENCES):
        own = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)  # (L, V)
        for t in range(1, len(seq)):
            tree_diff = max(tree_diff, abs(tree[s, t] - own[t - 1, seq[t]].item()))
            raw_diff = max(raw_diff, abs(raw[s, t] - own[t - 1, seq[t]].item()))
    assert tree_diff < 1e-5
    assert (raw_diff > 0.1) if transforms else (raw_diff < 1e-5)


REFUSED = {  # name: (config class, kwargs, the reason the error must name)
    "xlstm": (
        tf.xLSTMConfig,
        dict(vocab_size=97, hidden_size=32, embedding_dim=32, num_hidden_layers=2, num_heads=4),
        "takes no logits_to_keep",
    ),
    "mamba": (
        tf.MambaConfig,
        dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=8),
        r"layer types \['linear_attention'\]",
    ),
    "falcon_h1": (
        tf.FalconH1Config,
        {
            **DIMS,
            "head_dim": 8,
            "mamba_d_ssm": 32,
            "mamba_n_heads": 4,
            "mamba_d_head": 8,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_chunk_size": 8,
        },
        r"layer types \['hybrid'\]",
    ),
    "mistral_window_8": (
        tf.MistralConfig,
        {**DIMS, "sliding_window": 8},
        "sliding window 8 < trainer.max_row_tokens 64",
    ),
    "mpt": (
        tf.MptConfig,
        dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4),
        "prefix-tree logprobs differ from its own forward",
    ),
    "bloom": (
        tf.BloomConfig,
        dict(vocab_size=97, hidden_size=32, n_layer=2, n_head=4),
        "a prefix-tree forward fails",
    ),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_family_is_refused_at_start_with_one_line(family):
    config_class, kwargs, reason = REFUSED[family]
    model = _build(config_class, kwargs)
    with pytest.raises(ValueError, match=reason) as info:
        Trainer(model, max_row_tokens=64, device="cpu")
    message = str(info.value)
    assert message.startswith("model type ") and "\n" not in message
