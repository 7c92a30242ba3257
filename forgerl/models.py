"""Model and tokenizer loading: the packaged SmolLM2, any local HF folder, or a tiny random model.

`tiny` builds a 2-layer Llama-style model with random weights and a byte-level tokenizer in code
(unit tests, benchmarks); nothing here downloads anything.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with ChatML special tokens, built in code (no merges).

    Ids 0..2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`; ids 3..258 are the 256 bytes
    (GPT-2 byte-to-unicode alphabet), so any text round-trips. Vocab size 259.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(CHATML_SPECIAL)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(CHATML_SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def build_tiny_model(vocab_size: int = 259, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (hidden 64, 4 heads, 2 KV heads), fp32, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval()
