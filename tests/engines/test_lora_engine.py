"""LoRA adapters in the local engine (forgerl/engines/local/adapters.py).

Semantics pinned:
- Rows of different adapters (and the base) decode in one batch, and every recorded logprob is
  a teacher-forced forward of that row's adapter (forgerl.lora.MultiLoRA on the same base)
  within 1e-5, with nn.Linear and with oneDNN-packed linears; an adapter row's tokens record
  the adapter's version.
- CASES.md C23 on a toy model whose logits are the same at every position: base logits
  [2, 1, 0, -1]; adapter "bias" v1 is peft's fresh adapter (B = 0, the base), v2 adds 1 to
  token 1's logit through the attention values (so stale KV would show in the numbers). After
  syncing v2 over a 64-token prefix cached under v1: token 1's logprob is -0.781672 (v1's,
  -1.440190, never appears), 0 blocks (16 tokens each) are reused from v1 and 4 from v2; each
  version is read once (stats["adapter_loads"] == 2 for any number of requests); a request in
  flight across the sync keeps v1 (its tokens' versions and logprobs); a failed load of v3
  raises and leaves v2 active, its cache still used.
- Bad adapter input is a clear error: an adapter not loaded, tensors of other targets.
- PrefixCache namespaces: an entry of (adapter, version) serves only lookups of that namespace
  (not the base, not the next version); `drop` forgets one namespace and its tokens.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forgerl.engines.local import LocalEngine
from forgerl.engines.local.prefix_cache import PrefixCache
from forgerl.lora import MultiLoRA
from forgerl.models import build_tiny_model
from forgerl.types import SamplingParams

BLOCK = 16  # C23's block size: reused tokens / 16 = blocks


def _random_adapters(lora: MultiLoRA, names: list[str]) -> None:
    for i, name in enumerate(names):
        lora.add(name, rank=4, alpha=8.0, seed=i)
        gen = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for p in lora.parameters(name)[1::2]:  # B = 0 would make every adapter the base
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def _teacher_forced(lora: MultiLoRA, adapter: str | None, prompt: list[int],
                    completion: list[int]) -> list[float]:
    with torch.no_grad(), lora.active(adapter):
        logits = lora.model(torch.tensor([prompt + completion])).logits[0]
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("packed", [False, True], ids=["linear", "packed"])
def test_rows_of_different_adapters_decode_in_one_batch_token_exact(packed):
    ref = MultiLoRA(build_tiny_model(head_std=0.2))
    _random_adapters(ref, ["a", "b"])
    engine = LocalEngine(build_tiny_model(head_std=0.2), max_model_len=128,
                         packed_weights=packed)
    rows = ["a", "b", None, "a", "b", None]
    prompts = [[1, 40 + i, 41, 42 + 2 * i, 7] for i in range(len(rows))]

    async def go():
        await engine.load_adapter("a", ref.state_dict("a"), version=3, alpha=8.0)
        await engine.load_adapter("b", ref.state_dict("b"), version=7, alpha=8.0)
        try:
            return await asyncio.gather(*[
                engine.generate(p, SamplingParams(1.0, max_tokens=12, seed=i), adapter=a)
                for i, (p, a) in enumerate(zip(prompts, rows, strict=True))])
        finally:
            await engine.close()

    outs = asyncio.run(go())
    assert engine.stats["decode_rows"] / engine.stats["decode_steps"] > 3  # rows shared steps
    for prompt, adapter, out in zip(prompts, rows, outs, strict=True):
        assert len(out.completion_ids) == 12
        expected = _teacher_forced(ref, adapter, prompt, out.completion_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, expected, strict=True)) < 1e-5
        assert out.weight_versions == [{"a": 3, "b": 7, None: 0}[adapter]] * 12
    # the adapters matter: the same prompt scored under the base differs from a's logprobs
    base = _teacher_forced(ref, None, prompts[0], outs[0].completion_ids)
    assert max(abs(a - b) for a, b in zip(outs[0].logprobs, base, strict=True)) > 1e-2
    assert engine.stats["adapter_loads"] == 2


# ---- CASES.md C23 ----------------------------------------------------------------------------

V_PROJ = "base_model.model.model.layers.0.self_attn.v_proj.lora_{}.weight"


def _toy() -> LlamaForCausalLM:
    """One layer, hidden 64, one head, vocabulary 4. Every token embeds to 8·e0 (RMS 1); q and k
    are 0 (uniform attention), v is 0 (the base adds nothing), the MLP's output is 0, so the
    final hidden state is 8·e0 and the logits [2, 1, 0, -1] at every position. o_proj maps
    e0 to (-8, 8, 0, ...): a value of e0 turns the final state into 8·e1, whose logits are
    [2, 2, 0, -1] (token 1 + 1)."""
    config = LlamaConfig(vocab_size=4, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, rms_norm_eps=1e-12,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=3, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, *[m for n, m in model.named_modules()
                                         if n.endswith("layernorm")]):
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 8.0
        o_proj = model.model.layers[0].self_attn.o_proj.weight
        o_proj[0, 0], o_proj[1, 0] = -8.0, 8.0
        model.lm_head.weight[:, 0] = torch.tensor([2.0, 1.0, 0.0, -1.0]) / 8
        model.lm_head.weight[:, 1] = torch.tensor([2.0, 2.0, 0.0, -1.0]) / 8
    return model


def _bias_adapter(b: float, rank: int = 1) -> dict[str, torch.Tensor]:
    """v = B·A·x with A = e0ᵀ/8 (x = 8·e0 gives 1) and B = b·e0: v1 is b = 0, v2 b = 1."""
    a, bb = torch.zeros(rank, 64), torch.zeros(64, rank)
    a[0, 0], bb[0, 0] = 1 / 8, b
    return {V_PROJ.format("A"): a, V_PROJ.format("B"): bb}


def _logprobs(logits: list[float]) -> list[float]:
    lse = math.log(sum(math.exp(x) for x in logits))
    return [x - lse for x in logits]


BASE, V2 = _logprobs([2, 1, 0, -1]), _logprobs([2, 2, 0, -1])


@pytest.mark.prefix_cache
def test_c23_adapter_sync_without_stale_cache():
    assert round(BASE[1], 6) == -1.440190 and round(V2[1], 6) == -0.781672
    engine = LocalEngine(_toy(), max_model_len=256, prefix_cache_tokens=4096)
    prefix = [int(x) for x in torch.randint(0, 4, (64,), generator=torch.Generator()
                                           .manual_seed(0))]
    params = SamplingParams(1.0, max_tokens=8, seed=3)

    async def hits(prompt: list[int], **kw: object) -> tuple[int, object]:
        before = engine.stats["prefix_hit_tokens"]
        out = await engine.generate(prompt, kw.pop("params", params), adapter="bias")
        return engine.stats["prefix_hit_tokens"] - before, out

    async def go():
        await engine.load_adapter("bias", _bias_adapter(0.0), version=1, alpha=1.0)
        v1_hit, v1 = await hits([*prefix, 0])  # caches the 64-token prefix under v1
        # a long v1 request in flight across the sync
        flight = engine.stream([*prefix, 2], SamplingParams(1.0, max_tokens=150, seed=1),
                               adapter="bias")
        first = await anext(flight)
        await engine.load_adapter("bias", _bias_adapter(1.0), version=2, alpha=1.0)
        synced = time.perf_counter()
        v2_hit, v2 = await hits([*prefix, 1])  # nothing of v1's KV may be reused
        v2_again_hit, v2_again = await hits([*prefix, 3])  # v2's own prefix is
        events = [first] + [e async for e in flight]
        with pytest.raises(ValueError, match="has shape"):  # rank 2 A with rank 1 B
            bad = {**_bias_adapter(1.0), V_PROJ.format("A"): torch.zeros(2, 64)}
            await engine.load_adapter("bias", bad, version=3, alpha=1.0)
        after_fail_hit, after_fail = await hits([*prefix, 2, 2])
        await engine.close()
        return (v1_hit, v1, v2_hit, v2, v2_again_hit, v2_again, events, synced,
                after_fail_hit, after_fail)

    (v1_hit, v1, v2_hit, v2, v2_again_hit, v2_again, events, synced, after_fail_hit,
     after_fail) = asyncio.run(go())
    assert v1_hit == 0 and v1.weight_versions == [1] * 8
    assert v1.logprobs == pytest.approx([BASE[t] for t in v1.completion_ids], abs=1e-6)
    # post-sync: v2's numbers, 0 blocks from v1, then 4 blocks of v2's own KV
    assert 1 in v2.completion_ids and v2.weight_versions == [2] * 8
    assert v2.logprobs == pytest.approx([V2[t] for t in v2.completion_ids], abs=1e-6)
    assert next(round(lp, 6) for t, lp in zip(v2.completion_ids, v2.logprobs, strict=True)
            if t == 1) == -0.781672
    assert v2_hit // BLOCK == 0 and v2_again_hit // BLOCK == 4 and v2_again_hit == 64
    assert v2_again.logprobs == pytest.approx([V2[t] for t in v2_again.completion_ids],
                                              abs=1e-6)
    # the in-flight request kept v1 to its end, decoding after v2 was active
    out = events[-1]
    assert len(out.completion_ids) == 150 and events[-2].sampled_at > synced
    assert out.weight_versions == [1] * 150
    assert out.logprobs == pytest.approx([BASE[t] for t in out.completion_ids], abs=1e-6)
    assert any(round(lp, 6) == -1.440190 for lp in out.logprobs)
    # one read per version; the failed v3 left v2 active with its cache
    assert engine.stats["adapter_loads"] == 2
    assert engine.adapter_versions == {"bias": 2}
    assert after_fail.weight_versions == [2] * 8 and after_fail_hit == 64
    assert after_fail.logprobs == pytest.approx([V2[t] for t in after_fail.completion_ids],
                                                abs=1e-6)
    assert engine.lora.names() == ["bias@v2"]  # v1 dropped once its last row finished


def test_bad_adapter_requests_are_clear_errors():
    engine = LocalEngine(build_tiny_model(), max_model_len=64)

    async def go():
        try:
            with pytest.raises(ValueError, match="'nope' is not loaded"):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=2), adapter="nope")
            ref = MultiLoRA(build_tiny_model(), ("q_proj",))
            ref.add("q", 2, 4.0)
            await engine.load_adapter("q", ref.state_dict("q"), version=1, alpha=4.0)
            other = MultiLoRA(build_tiny_model(), ("v_proj",))
            other.add("v", 2, 4.0)
            with pytest.raises(ValueError, match="targets"):
                await engine.load_adapter("v", other.state_dict("v"), version=1, alpha=4.0)
            await engine.remove_adapter("q")
            with pytest.raises(KeyError):
                await engine.remove_adapter("q")
            assert engine.adapter_versions == {}
        finally:
            await engine.close()

    asyncio.run(go())


def test_prefix_cache_namespaces_never_mix():
    cache = PrefixCache(max_tokens=100)
    kv = [(torch.arange(6.0).view(1, 6, 1), torch.zeros(1, 6, 1))]
    cache.insert((5, 6, 7, 8, 9, 10), kv, ns=("a", 1))
    assert cache.tokens == 6
    assert cache.lookup((5, 6, 7, 8, 1)) == (0, None)  # the base sees nothing of a's KV
    assert cache.lookup((5, 6, 7, 8, 1), ("a", 2)) == (0, None)  # nor does a's next version
    n, hit = cache.lookup((5, 6, 7, 8, 1), ("a", 1))
    assert n == 4 and hit[0][0].flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    cache.insert((5, 6, 7), kv, ns=None)  # a base entry beside it: its own namespace
    assert cache.tokens == 9 and cache.lookup((5, 6, 7, 8))[0] == 3
    cache.drop(("a", 1))
    assert cache.tokens == 3 and cache.lookup((5, 6, 7, 8, 1), ("a", 1)) == (0, None)
