"""The unmodified `tinker` SDK against `forgerl serve`'s app on the tiny model: training,
losses, checkpoints, sampling, two runs at once, and errors."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from forgerl.models import build_tiny_model
from forgerl.tinker.service import SAMPLER_SLOTS
from tests.tinker.conftest import TINY

TOKENS = [5, 40, 72, 101, 108, 108, 111, 33, 9, 200, 31, 17]


def base_logprobs(tokens: list[int], adapter: dict[str, torch.Tensor] | None = None,
                  scale: float = 16.0 / 4) -> torch.Tensor:
    """log p(tokens[t+1] | tokens[:t+1]) (N-1,) from a plain forward of a fresh tiny model, with
    a peft adapter merged into its weights (W + scale · B @ A) when given."""
    model = build_tiny_model(head_std=0.2)
    if adapter:
        params = dict(model.named_parameters())
        for key, a in adapter.items():
            if ".lora_A." in key:
                module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = adapter[key.replace(".lora_A.", ".lora_B.")]
                params[module + ".weight"].data += scale * b @ a
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def datum(tokens: list[int], **inputs: np.ndarray) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), **inputs})


def test_round_trip_cross_entropy_optim_and_sampling(server):
    client = tinker.ServiceClient(base_url=server.url)
    caps = tinker.RestClient(base_url=server.url).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [TINY]
    trainer = client.create_lora_training_client(base_model=TINY, rank=4).result()
    assert trainer.get_info().lora_rank == 4
    weights = np.linspace(0.2, 1.0, len(TOKENS) - 1).astype(np.float32)
    d = datum(TOKENS, weights=weights)
    hand = -(torch.tensor(weights) * base_logprobs(TOKENS)).sum().item()  # B = 0: the base
    losses = []
    for _ in range(4):
        out = trainer.forward_backward([d], "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        trainer.optim_step(types.AdamParams(learning_rate=0.02)).result()
    assert losses[0] == pytest.approx(hand, abs=1e-5)
    assert np.allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy().shape, (len(TOKENS) - 1,))
    assert losses[-1] < losses[0] - 1.0, losses  # it learns

    path = trainer.save_weights_for_sampler("after4").result().path
    assert path == f"tinker://{trainer.model_id}/sampler_weights/after4"
    folder = server.service.folder(path)
    assert (folder / "adapter_config.json").is_file()
    adapter = load_file(str(folder / "adapter_model.safetensors"))  # peft key names
    assert any(k.endswith("q_proj.lora_B.weight") for k in adapter)
    sampler = client.create_sampling_client(model_path=path).result()
    prompt = TOKENS[:6]
    result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                            sampling_params=types.SamplingParams(max_tokens=8, seed=7, stop=[]),
                            include_prompt_logprobs=True).result()
    assert len(result.sequences) == 3
    for seq in result.sequences:
        assert len(seq.tokens) == 8 and seq.stop_reason == "length"
        forced = base_logprobs(prompt + seq.tokens, adapter)[len(prompt) - 1:]
        assert np.allclose(seq.logprobs, forced.numpy(), atol=1e-5), (seq.logprobs, forced)
    assert result.prompt_logprobs[0] is None
    assert np.allclose(result.prompt_logprobs[1:],
                       base_logprobs(prompt, adapter).numpy(), atol=1e-5)
    # the same seed gives the same samples; a sampler of the base model differs
    again = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                           sampling_params=types.SamplingParams(max_tokens=8, seed=7, stop=[])
                           ).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]
    for seq in again.sequences:  # (with the engine: sampled in its batch, not with the above)
        forced = base_logprobs(prompt + seq.tokens, adapter)[len(prompt) - 1:]
        assert np.allclose(seq.logprobs, forced.numpy(), atol=1e-5)


def test_policy_gradient_losses_equal_hand_computation(server):
    trainer = tinker.ServiceClient(base_url=server.url).create_lora_training_client(
        base_model=TINY, rank=2).result()
    n = len(TOKENS) - 1
    q = base_logprobs(TOKENS).numpy() + np.linspace(-0.5, 0.5, n).astype(np.float32)
    adv = np.where(np.arange(n) % 3 == 0, -1.0, 0.7).astype(np.float32)
    d = datum(TOKENS, logprobs=q, advantages=adv)
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    got = {fn: trainer.forward([d], fn, cfg).result() for fn in ("importance_sampling",
                                                                  "ppo", "cispo")}
    p = got["ppo"].loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
    assert np.allclose(p, base_logprobs(TOKENS).numpy(), atol=1e-5)
    r = np.exp(p - q)
    hand = {"importance_sampling": -(r * adv).sum(),
            "ppo": -np.minimum(r * adv, np.clip(r, 0.9, 1.1) * adv).sum(),
            "cispo": -(np.clip(r, 0.9, 1.1) * adv * p).sum()}
    for fn, value in hand.items():
        assert got[fn].metrics["loss:sum"] == pytest.approx(value, abs=1e-5), fn
    assert hand["ppo"] != pytest.approx(hand["importance_sampling"])  # the clip mattered


def test_two_training_clients_are_independent(server):
    client = tinker.ServiceClient(base_url=server.url)
    a = client.create_lora_training_client(base_model=TINY, rank=4).result()
    b = client.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    d = datum(TOKENS)
    b.forward_backward([d], "cross_entropy").result()
    b.optim_step(types.AdamParams(learning_rate=0.01)).result()
    lora = server.service.lora
    def snapshot(model_id: str) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in lora.state_dict(model_id).items()}
    b_before, a_before = snapshot(b.model_id), snapshot(a.model_id)
    for _ in range(2):
        a.forward_backward([d], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=0.01)).result()
    b_after, a_after = lora.state_dict(b.model_id), lora.state_dict(a.model_id)
    assert all(torch.equal(b_before[k], b_after[k]) for k in b_before)  # bitwise
    assert not all(torch.equal(a_before[k], a_after[k]) for k in a_before)
    # a saved state restores into a new run, optimizer included
    state = a.save_state("s1").result().path
    c = client.create_training_client_from_state_with_optimizer(state).result()
    c_sd = lora.state_dict(c.model_id)
    assert all(torch.equal(c_sd[k], a_after[k]) for k in a_after)


def test_bad_requests_get_clear_errors(server):
    client = tinker.ServiceClient(base_url=server.url)
    with pytest.raises(tinker.BadRequestError, match="is not served"):
        client.create_lora_training_client(base_model="nope/model", rank=4).result()
    trainer = client.create_lora_training_client(base_model=TINY, rank=2).result()
    with pytest.raises(Exception, match="needs loss_fn_inputs\\['advantages'\\]"):
        trainer.forward_backward([datum(TOKENS, logprobs=np.zeros(11, np.float32))],
                                 "ppo").result()
    for path, body in (("/api/v1/nothing", {}), ("/api/v1/get_info", {"model_id": "run99"}),
                       ("/api/v1/create_model", {"x": 1})):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"], (path, r.text)
    r = httpx.post(server.url + "/api/v1/forward_backward", content=b"\xff\x00garbage")
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["error"]


def test_resaved_sampler_path_serves_the_new_weights_and_bad_input_is_a_user_error(server):
    """A snapshot saved again under the same name is sampled with its new weights (no stale
    cached adapter); a failed load keeps the run's weights; a bad optim_step body or sampling
    bound is a 400/user error, not a 500 the SDK retries."""
    client = tinker.ServiceClient(base_url=server.url)
    trainer = client.create_lora_training_client(base_model=TINY, rank=4).result()
    prompt = types.ModelInput.from_ints(TOKENS[:5])
    params = types.SamplingParams(max_tokens=6, seed=3, stop=[])

    def logprobs(path: str) -> np.ndarray:
        sampler = client.create_sampling_client(model_path=path).result()
        seq = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
        return np.array(seq.logprobs)
    first = logprobs(trainer.save_weights_for_sampler("same").result().path)
    for _ in range(3):
        trainer.forward_backward([datum(TOKENS)], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
    resaved = logprobs(trainer.save_weights_for_sampler("same").result().path)
    fresh = logprobs(trainer.save_weights_for_sampler("fresh").result().path)
    assert np.allclose(resaved, fresh, atol=1e-6) and not np.allclose(resaved, first, atol=1e-3)

    before = {k: v.clone() for k, v in server.service.lora.state_dict(trainer.model_id).items()}
    sampler_path = f"tinker://{trainer.model_id}/sampler_weights/same"
    with pytest.raises(Exception, match="has no optimizer state"):
        trainer.load_state_with_optimizer(sampler_path).result()
    after = server.service.lora.state_dict(trainer.model_id)
    assert all(torch.equal(before[k], after[k]) for k in before)

    r = httpx.post(server.url + "/api/v1/optim_step",
                   json={"model_id": trainer.model_id, "adam_params": {"learning_rate": None}})
    assert r.status_code == 400 and "learning_rate" in r.json()["error"], r.text
    with pytest.raises(Exception, match="sampling_params: temperature"):
        client.create_sampling_client(base_model=TINY).result().sample(
            prompt, num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=4, temperature=-1.0)).result()


def test_more_concurrent_samplers_than_slots_all_answer(server):
    """SAMPLER_SLOTS + 3 snapshots sampled at once: none fails because another request's load
    removed its adapter (the engine path said "LoRA adapter ... was removed"); each answers as it
    does alone."""
    client = tinker.ServiceClient(base_url=server.url)
    trainer = client.create_lora_training_client(base_model=TINY, rank=4).result()
    paths = []
    for i in range(SAMPLER_SLOTS + 3):
        trainer.forward_backward([datum(TOKENS)], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
        paths.append(trainer.save_weights_for_sampler(f"s{i}").result().path)
    prompt, params = types.ModelInput.from_ints(TOKENS[:5]), types.SamplingParams(
        max_tokens=24, seed=3, stop=[])

    async def sample_all() -> list:
        samplers = [await client.create_sampling_client_async(model_path=p) for p in paths]
        return await asyncio.gather(*(s.sample_async(prompt, num_samples=2, sampling_params=params)
                                      for s in samplers))
    together = asyncio.run(sample_all())
    for path, out in zip(paths, together, strict=True):
        alone = client.create_sampling_client(model_path=path).result().sample(
            prompt, num_samples=2, sampling_params=params).result()
        assert [s.tokens for s in out.sequences] == [s.tokens for s in alone.sequences]
        assert np.allclose(out.sequences[0].logprobs, alone.sequences[0].logprobs, atol=1e-5)


def test_a_bad_datum_adds_no_gradient_of_the_good_ones(server):
    """forward_backward([good, bad]) fails as a whole: the good datum's gradient was added
    before the bad one was seen, and the next optim_step stepped on it (grad_norm > 0)."""
    client = tinker.ServiceClient(base_url=server.url)
    trainer = client.create_lora_training_client(base_model=TINY, rank=4).result()
    trainer.forward_backward([datum(TOKENS)], "cross_entropy").result()
    assert trainer.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics[
        "optim/grad_norm"] > 0  # a good datum does add a gradient
    bad = datum(TOKENS, weights=np.ones(3, np.float32))  # 3 weights for 11 targets
    with pytest.raises(Exception, match="has 3 values for 11 target tokens"):
        trainer.forward_backward([datum(TOKENS), bad], "cross_entropy").result()
    with pytest.raises(Exception, match="out of the vocabulary"):
        trainer.forward_backward([datum(TOKENS), datum([1, 2, 9999, 3])], "cross_entropy").result()
    assert trainer.optim_step(types.AdamParams(learning_rate=0.05)).result().metrics[
        "optim/grad_norm"] == 0.0
