"""Model loading pins: the packaged SmolLM2 and local HF folders load offline through one call.

Semantics pinned: `load_pretrained("smollm2")` gives the 30-layer, 134.5M-parameter,
49152-token SmolLM2-135M-Instruct in fp32 with sdpa attention, its ChatML end-of-turn id, and
deterministic finite greedy decoding; any other path is a local folder that round-trips a model
and tokenizer saved with `save_pretrained` (identical logits, identical ids); a family without
sdpa support (Gemma2) loads with eager attention and is accepted by the trainer.
"""

from __future__ import annotations

import pytest
import torch

from forgerl.models import build_byte_tokenizer, build_tiny_model, load_pretrained


@pytest.fixture(scope="module")
def smollm2():
    return load_pretrained("smollm2")


@pytest.mark.smollm2
def test_smollm2_shape_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.vocab_size == 49152
    assert model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    # SmolLM2's ChatML specials sit at ids 1 and 2; the end of turn is also the EOS.
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.eos_token_id == 2


@pytest.mark.smollm2
def test_smollm2_greedy_chatml_is_deterministic(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids  # (1, P)
    with torch.no_grad():
        logits = model(ids).logits  # (1, P, 49152)
        runs = [
            model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
            for _ in range(2)
        ]
    assert torch.isfinite(logits).all()
    assert runs[0] == runs[1]
    assert len(runs[0]) == 6
    # The first greedy token is the argmax of the last prompt position.
    assert runs[0][0] == int(logits[0, -1].argmax())
    assert "Paris" in tokenizer.decode(runs[0])


def test_local_folder_round_trip(tmp_path):
    model, tokenizer = build_tiny_model(), build_byte_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tok = load_pretrained(str(tmp_path))
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tokenizer(text).input_ids
    assert loaded_tok(text).input_ids == ids
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 2 + len("user\nhi")
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert saved.keys() == reloaded.keys()
    assert all(torch.equal(saved[k], reloaded[k]) for k in saved)  # a bit-exact file round trip
    batch = torch.tensor([ids])  # (1, T)
    with torch.no_grad():
        # Same weights, but two separately allocated models: CPU BLAS kernels may pick other code
        # paths (alignment, blocking), so the logits are compared within 1e-5, not bit for bit.
        torch.testing.assert_close(loaded(batch).logits, model(batch).logits, atol=1e-5, rtol=0)
    assert loaded.config._attn_implementation == "sdpa"


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="neither 'smollm2' nor a local HF folder"):
        load_pretrained(str(tmp_path / "nope"))


def test_family_without_sdpa_loads_eager_and_trains(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from forgerl.trainer.trainer import Trainer
    from tests.trainer.test_model_families import DIMS

    config = Gemma2Config(**DIMS | {"vocab_size": 259, "head_dim": 8})
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    model, _ = load_pretrained(str(tmp_path))
    assert model.config._attn_implementation == "eager"
    trainer = Trainer(model, device="cpu")  # softcapped logits pass the tree-support probe
    assert trainer.attn_implementation == "eager"
