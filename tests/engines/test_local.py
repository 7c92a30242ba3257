"""LocalEngine semantics: what the rollout engine promises the gateway and the trainer.

Pinned here, on the tiny random Llama from tests/conftest.py (fp32, CPU):
- KV-cached greedy decoding equals a naive full-forward argmax loop token for token, and a
  batched run (concurrent prompts of different lengths, some joining a running batch) equals
  each prompt run alone, logprobs within 1e-4; seeded sampling is batch-independent too.
- Recorded logprobs are the behavior policy's: for sampled completions they equal a
  teacher-forced forward with log_softmax(logits / T) (CASES.md C04 replayed through the helper:
  logits [2, 1, 0] at T 0.5 give -0.142932 for token 0, and greedy uses T = 1, -0.407606).
- Output lengths agree; a stop id ends the completion and is kept with its logprob; max_tokens
  ends it with "length".
- A weight update lands between decode steps of a running generation: weight_versions read
  0…0 1…1 and the later tokens' logprobs are those of the new weights; a bad update raises and
  leaves weight_version alone.
- Requests that cannot be served raise ValueError (too long, empty, params out of range such
  as top_p 0 or repetition_penalty 0, bad ids).
- Prefix caching (KV reuse) is invisible in the outputs: a request sharing a prefix with an
  earlier one (or a group sharing a system prompt, sent together) reuses exactly the shared
  tokens' KV and produces the cache-off engine's ids and logprobs (within 1e-4); a group's
  later rows, whose cache hit leaves one token, join the next decode step without a prefill
  forward of their own; a multi-turn
  turn-2 prompt reuses turn 1's prompt + completion; a weight update empties the cache so later
  logprobs are the new weights' teacher-forced ones (CASES.md C04); the cache stays within its
  token bound, evicting the least recently used entry.
- With `packed_weights` on CPU in fp32 the engine's linears run on oneDNN-packed copies of
  their weights (`pack_linears`): logits equal nn.Linear's within 1e-5, a weight change shows
  only once they are packed again, other dtypes are left alone; full and delta updates rebuild
  them (tests/trainer/test_weight_sync.py).
- A decode step with no padded row runs `engine_sdpa`: one-token queries folded onto their
  key/value heads give naive grouped-query attention (fp32 within 1e-6, bf16 within bf16
  rounding) over the cache's strided views; with a mask it is transformers' sdpa; the engine's
  copy of the model uses it, the caller's model keeps its own.
- The KV layer grows and drops rows in place: decode steps and `keep` (rows finished, leading
  padding trimmed) write into the same buffers and leave exactly the reference tensors;
  tensors replaced from outside are gathered instead.
"""

from __future__ import annotations

import asyncio
import copy
import time
from types import SimpleNamespace

import pytest
import torch

from forgerl.engines.local import LocalEngine
from forgerl.engines.local.kernels import ENGINE_SDPA, engine_sdpa, pack_linears
from forgerl.engines.local.kv_batch import _GrowingLayer
from forgerl.engines.local.prefix_cache import PrefixCache, common_prefix
from forgerl.engines.local.sampler import sample_tokens, sampling_logprobs
from forgerl.types import GenerateOutput, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def naive_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Reference: full forward over the whole sequence at every step, argmax, T = 1 logprob."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], lps


def teacher_forced(model, prompt: list[int], completion: list[int], t: float) -> list[float]:
    """log_softmax(logits / T)[token] for every completion token, one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]  # (P + C, V)
    logp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]  # (C, V)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


async def start_decoding(engine: LocalEngine, prompt: list[int], max_tokens: int) -> asyncio.Task:
    """A greedy generation as a task, returned once the engine is decoding it."""
    task = asyncio.create_task(engine.generate(prompt, SamplingParams(0.0, max_tokens=max_tokens)))
    while engine._batch is None:
        await asyncio.sleep(0.001)
    return task


def run(coro):
    return asyncio.run(coro)


async def _alone(model, prompt: list[int], params: SamplingParams) -> GenerateOutput:
    engine = LocalEngine(model, max_model_len=256)
    try:
        return await engine.generate(prompt, params)
    finally:
        await engine.close()


def sample_logprobs(logits, temperature, generator=None):
    """One row through the engine's sampler: logits (V,) → (token id, logprob)."""
    tokens, logprobs = sample_tokens(logits.unsqueeze(0), [SamplingParams(temperature)],
                                     [generator])
    return int(tokens[0]), float(logprobs[0])


def test_inverse_cdf_draws_follow_the_tempered_distribution():
    # softmax([2, 1, 0, -inf] / 0.5) = [0.8668, 0.1173, 0.0159, 0]: 20,000 draws in one batch,
    # a mix of seeded rows and greedy rows; the masked token is never drawn
    n = 20_000
    logits = torch.tensor([2.0, 1.0, 0.0, float("-inf")]).repeat(n, 1)
    temps = [SamplingParams(0.5 if i % 4 else 0.0) for i in range(n)]
    gen = torch.Generator().manual_seed(1)
    tokens, _ = sample_tokens(logits, temps, [gen] * n)
    greedy = tokens[::4]
    assert greedy.eq(0).all()
    sampled = torch.cat([tokens[i::4] for i in (1, 2, 3)])
    freq = torch.bincount(sampled, minlength=4).double() / len(sampled)
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64) / 0.5, 0)
    assert freq[3] == 0
    assert torch.allclose(freq[:3], expected, atol=0.01)  # 4.4 standard errors at p = 0.13
    # the same seed replays the same draws
    again, _ = sample_tokens(logits, temps, [torch.Generator().manual_seed(1)] * n)
    assert torch.equal(tokens, again)


def test_c04_sampling_logprobs_helper():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    lp = sampling_logprobs(logits, [SamplingParams(0.5)])
    assert lp[0, 0].item() == pytest.approx(-0.142932, abs=1e-6)
    # greedy records the T = 1 distribution
    assert sample_logprobs(logits[0], 0.0) == (0, pytest.approx(-0.407606, abs=1e-6))
    gen = torch.Generator().manual_seed(0)
    draws = [sample_logprobs(logits[0], 0.5, gen) for _ in range(400)]
    expected = lp[0].tolist()
    assert all(lp_ == pytest.approx(expected[tok], abs=1e-6) for tok, lp_ in draws)
    # p(token 0) = 0.8668 at T = 0.5; 400 draws put the frequency well within ±0.07
    assert abs(sum(tok == 0 for tok, _ in draws) / 400 - 0.8668) < 0.07


def test_greedy_equals_naive_loop(tiny_model):
    prompt = [1, 40, 41, 42, 7]
    out = run(_alone(tiny_model, prompt, GREEDY))
    ref_ids, ref_lps = naive_greedy(tiny_model, prompt, GREEDY.max_tokens)
    assert out.completion_ids == ref_ids
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lps, strict=True)) < 1e-4
    assert out.weight_versions == [0] * GREEDY.max_tokens
    assert out.finish_reason == "length"


def test_batched_and_joining_equal_unbatched(tiny_model):
    prompts = [[5, 6, 7], list(range(10, 40)), [100], list(range(50, 62)), [9, 9, 9, 9]]
    params = [
        GREEDY,
        GREEDY,
        SamplingParams(temperature=0.7, max_tokens=30, seed=3),
        GREEDY,
        SamplingParams(temperature=1.3, max_tokens=10, seed=11),
    ]

    async def batched() -> list[GenerateOutput]:
        engine = LocalEngine(tiny_model, max_model_len=256, max_batch_size=4)

        async def late(i: int, delay: float) -> GenerateOutput:
            await asyncio.sleep(delay)
            return await engine.generate(prompts[i], params[i])

        together = await asyncio.gather(
            *[engine.generate(p, s) for p, s in zip(prompts, params, strict=True)]
        )
        staggered = await asyncio.gather(*[late(i, 0.005 * i) for i in range(len(prompts))])
        await engine.close()
        stats.update(engine.stats)
        return together + staggered

    stats: dict = {}
    outs = run(batched())
    # every decode step samples one token per running row; a row's first token is its
    # prefill's, except for staggered repeats of the four multi-token prompts that arrive
    # alone: the cache holds all of each but its last token, which a decode step feeds (one
    # that joins a wave with another newcomer's prefill is sampled there: timing decides)
    joined = stats["decode_rows"] - sum(len(o.completion_ids) - 1 for o in outs)
    assert 0 <= joined <= 4
    assert 0 < stats["decode_steps"] <= stats["decode_rows"] <= 4 * stats["decode_steps"]
    assert stats["decode_seconds"] > 0 and stats["prefill_seconds"] > 0
    for i, out in enumerate(outs):
        alone = run(_alone(tiny_model, prompts[i % 5], params[i % 5]))
        assert out.completion_ids == alone.completion_ids, i
        assert max(abs(a - b) for a, b in zip(out.logprobs, alone.logprobs, strict=True)) < 1e-4


def test_newcomer_joins_running_batch(tiny_model):
    """A short request sent while a long one decodes finishes first (it did not wait)."""

    async def main() -> tuple[GenerateOutput, GenerateOutput, list[str]]:
        engine = LocalEngine(tiny_model, max_model_len=1024)
        order: list[str] = []

        async def tagged(name: str, prompt: list[int], n: int) -> GenerateOutput:
            out = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n))
            order.append(name)
            return out

        long_task = asyncio.create_task(tagged("long", [3, 4, 5], 300))
        while engine._batch is None:  # wait until the long row is decoding
            await asyncio.sleep(0.001)
        short = await tagged("short", [60, 61, 62, 63, 64, 65], 5)
        long = await long_task
        await engine.close()
        return long, short, order

    long, short, order = run(main())
    assert order == ["short", "long"]
    assert short.completion_ids == naive_greedy(tiny_model, [60, 61, 62, 63, 64, 65], 5)[0]
    assert long.completion_ids[:20] == naive_greedy(tiny_model, [3, 4, 5], 20)[0]


def test_sampled_logprobs_match_teacher_forcing(tiny_model):
    prompts = [[1, 20, 21, 22], list(range(70, 90))]

    async def main() -> list[GenerateOutput]:
        engine = LocalEngine(tiny_model, max_model_len=256)
        outs = await asyncio.gather(
            *[
                engine.generate(p, SamplingParams(temperature=0.7, max_tokens=40, seed=7 + i))
                for i, p in enumerate(prompts)
            ]
        )
        again = await engine.generate(prompts[0], SamplingParams(0.7, max_tokens=40, seed=7))
        await engine.close()
        return [*outs, again]

    outs = run(main())
    for prompt, out in zip(prompts, outs, strict=False):
        ref = teacher_forced(tiny_model, prompt, out.completion_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)) < 1e-4
        assert len(set(out.completion_ids)) > 5  # really sampled, not a greedy loop
    assert outs[2].completion_ids == outs[0].completion_ids  # same seed, same completion


def test_stop_id_and_lengths(tiny_model):
    prompt = [1, 33, 34]
    ref_ids, ref_lps = naive_greedy(tiny_model, prompt, 12)
    stop = ref_ids[6]
    cut = ref_ids.index(stop) + 1
    out = run(
        _alone(tiny_model, prompt, SamplingParams(0.0, max_tokens=12, stop_token_ids=(stop, 258)))
    )
    assert out.finish_reason == "stop"
    assert out.completion_ids == ref_ids[:cut] and out.completion_ids[-1] == stop
    assert out.logprobs[-1] == pytest.approx(ref_lps[cut - 1], abs=1e-4)
    assert len(out.completion_ids) == len(out.logprobs) == len(out.weight_versions) == cut
    one = run(_alone(tiny_model, prompt, SamplingParams(0.0, max_tokens=1)))
    assert (one.completion_ids, one.finish_reason) == ([ref_ids[0]], "length")


def perturbed(model, seed: int):
    """A copy of `model` with every parameter moved by 0.05 * N(0, 1) noise (seeded)."""
    new_model = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return new_model


def test_weight_update_mid_generation(tiny_model):
    new_model = perturbed(tiny_model, seed=1)
    new_state = new_model.state_dict()
    snapshot = {name: v.clone() for name, v in tiny_model.state_dict().items()}
    prompt = [1, 50, 51, 52]
    t = 0.7

    async def main() -> tuple[GenerateOutput, int]:
        engine = LocalEngine(tiny_model, max_model_len=1024)
        task = asyncio.create_task(
            engine.generate(prompt, SamplingParams(temperature=t, max_tokens=300, seed=5))
        )
        while engine._batch is None or len(engine._batch.rows[0].completion_ids) < 3:
            await asyncio.sleep(0.001)
        await engine.update_weights(new_state, 1)
        version = engine.weight_version
        out = await task
        await engine.close()
        return out, version

    out, version = run(main())
    assert version == 1
    k = out.weight_versions.index(1)
    assert k >= 3 and out.weight_versions == [0] * k + [1] * (len(out.completion_ids) - k)
    old = teacher_forced(tiny_model, prompt, out.completion_ids, t)
    new = teacher_forced(new_model, prompt, out.completion_ids, t)
    assert max(abs(a - b) for a, b in zip(out.logprobs[:k], old[:k], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(out.logprobs[k:], new[k:], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(new[k:], old[k:], strict=True)) > 1e-2  # really new
    after = tiny_model.state_dict()  # the caller's model is untouched
    assert all(torch.equal(after[name], value) for name, value in snapshot.items())


def test_failed_update_keeps_weights(tiny_model):
    prompt = [1, 2, 3, 4]

    async def main() -> tuple[GenerateOutput, GenerateOutput, int]:
        engine = LocalEngine(tiny_model, max_model_len=256)
        before = await engine.generate(prompt, GREEDY)
        bad = dict(tiny_model.state_dict())
        bad["model.norm.weight"] = torch.ones(3)
        with pytest.raises(ValueError, match=r"model\.norm\.weight"):
            await engine.update_weights(bad, 1)
        with pytest.raises(ValueError, match="unknown"):
            await engine.update_weights({"not.a.weight": torch.ones(1)}, 1)
        meta = dict(tiny_model.state_dict(), **{"model.norm.weight": torch.empty(
            tiny_model.state_dict()["model.norm.weight"].shape, device="meta")})
        with pytest.raises(ValueError, match="meta"):  # caught before any tensor is copied
            await engine.update_weights(meta, 1)
        after = await engine.generate(prompt, GREEDY)
        version = engine.weight_version
        await engine.close()
        return before, after, version

    before, after, version = run(main())
    assert version == 0
    assert (after.completion_ids, after.weight_versions, after.finish_reason) == (
        before.completion_ids,
        before.weight_versions,
        before.finish_reason,
    )
    # Not bit-equal: `after` reuses `before`'s prompt KV from the prefix cache, and prefilling
    # one token over cached KV rounds differently from a full prefill (~5e-7 apart on AVX2 EPYC).
    # 1e-5 is far below what a changed weight would move (perturbed(): > 1e-2).
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-5)


def test_request_errors_and_close(tiny_model):
    async def main() -> GenerateOutput:
        engine = LocalEngine(tiny_model, max_model_len=64)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.generate([5] * 60, SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match="empty"):
            await engine.generate([], SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate([5], SamplingParams(top_p=0.0, max_tokens=5))
        with pytest.raises(ValueError, match="repetition_penalty"):
            await engine.generate([5], SamplingParams(repetition_penalty=0.0, max_tokens=5))
        with pytest.raises(ValueError, match="259"):
            await engine.generate([5, 259], SamplingParams(max_tokens=5))
        ok = await engine.generate([5] * 59, SamplingParams(temperature=0.0, max_tokens=5))
        await engine.close()
        await engine.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate([5], SamplingParams(max_tokens=5))
        return ok

    ok = run(main())
    assert len(ok.completion_ids) == 5 and ok.finish_reason == "length"


def test_close_aborts_in_flight(tiny_model):
    async def main() -> GenerateOutput:
        engine = LocalEngine(tiny_model, max_model_len=2048)
        task = asyncio.create_task(engine.generate([7, 8], SamplingParams(0.0, max_tokens=2000)))
        start = time.monotonic()
        while engine._batch is None and time.monotonic() - start < 10:
            await asyncio.sleep(0.001)
        await engine.close()
        return await task

    out = run(main())
    assert out.finish_reason == "abort" and 0 < len(out.completion_ids) < 2000
    n = min(len(out.completion_ids), 20)
    assert out.completion_ids[:n] == naive_greedy(tiny_model, [7, 8], n)[0]


def test_failed_forward_fails_its_rows_only(tiny_model):
    """A forward that raises reaches the waiting callers; the engine keeps serving."""

    async def main() -> GenerateOutput:
        engine = LocalEngine(tiny_model, max_model_len=256)
        forward = engine.model.forward

        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        engine.model.forward = broken
        with pytest.raises(RuntimeError, match="boom"):
            await engine.generate([1, 2, 3], GREEDY)
        engine.model.forward = forward
        out = await engine.generate([1, 2, 3], GREEDY)
        await engine.close()
        return out

    out = run(main())
    assert out.completion_ids == naive_greedy(tiny_model, [1, 2, 3], GREEDY.max_tokens)[0]


def test_cancelled_request_frees_its_slot(tiny_model):
    """With one slot, a cancelled long generation leaves at once and the next request runs."""

    async def main() -> GenerateOutput:
        engine = LocalEngine(tiny_model, max_model_len=4096, max_batch_size=1)
        long = await start_decoding(engine, [4, 5], 4000)
        long.cancel()
        out = await asyncio.wait_for(engine.generate([1, 2, 3], GREEDY), timeout=5)
        await engine.close()
        return out

    out = run(main())
    assert out.completion_ids == naive_greedy(tiny_model, [1, 2, 3], GREEDY.max_tokens)[0]


# ---- prefix caching ----------------------------------------------------------------------------

SYSTEM = [1, *range(100, 140)]  # a 41-token shared "system prompt"


async def _serve(
    engine: LocalEngine, jobs: list[tuple[list[int], SamplingParams]], together: bool
) -> list[GenerateOutput]:
    if together:
        return list(await asyncio.gather(*[engine.generate(p, s) for p, s in jobs]))
    return [await engine.generate(p, s) for p, s in jobs]


def _outputs(model, jobs, together: bool, cache_tokens: int) -> tuple[list[GenerateOutput], dict]:
    async def main() -> tuple[list[GenerateOutput], dict]:
        engine = LocalEngine(model, max_model_len=256, prefix_cache_tokens=cache_tokens)
        outs = await _serve(engine, jobs, together)
        await engine.close()
        return outs, dict(engine.stats)

    return run(main())


def _assert_same(outs: list[GenerateOutput], refs: list[GenerateOutput]) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert out.completion_ids == ref.completion_ids
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs, strict=True)) < 1e-4


@pytest.mark.prefix_cache
@pytest.mark.parametrize("together", [False, True])
def test_prefix_hit_matches_cache_off(tiny_model, together):
    """Sequential: later requests reuse the first one's prompt KV. Together (a group sent at
    once): the first row prefills the shared prompt, the other three reuse it."""
    suffixes = [[50, 51, 52], [60, 61], [70, 71, 72, 73], [80]]
    jobs = [
        (SYSTEM + sfx, SamplingParams(0.8, max_tokens=12, seed=i) if i % 2 else GREEDY)
        for i, sfx in enumerate(suffixes)
    ]
    outs, stats = _outputs(tiny_model, jobs, together, cache_tokens=4096)
    refs, off = _outputs(tiny_model, jobs, together, cache_tokens=0)
    _assert_same(outs, refs)
    assert stats["prefix_hits"] == 3 and stats["prefix_hit_tokens"] == 3 * len(SYSTEM)
    total = sum(len(p) for p, _ in jobs)
    assert stats["prefill_tokens"] == total - 3 * len(SYSTEM)
    assert (off["prefill_tokens"], off["prefix_hits"], off["prefix_hit_tokens"]) == (total, 0, 0)
    for (prompt, params), out in zip(jobs, outs, strict=True):
        t = params.temperature or 1.0
        ref = teacher_forced(tiny_model, prompt, out.completion_ids, t)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)) < 1e-4


@pytest.mark.prefix_cache
@pytest.mark.parametrize("together", [False, True])
def test_group_siblings_join_the_decode_step_without_a_prefill(tiny_model, together):
    """G = 4 rollouts of one prompt: once the first has prefilled it, each sibling's cache hit
    leaves one token, which the next decode step feeds; the model runs one prefill forward in
    all and the outputs equal the cache-off engine's."""
    jobs = [([*SYSTEM, 7, 8], SamplingParams(1.0, max_tokens=10, seed=i)) for i in range(4)]

    def outputs(cache_tokens: int) -> tuple[list[GenerateOutput], dict, int]:
        async def main():
            engine = LocalEngine(tiny_model, max_model_len=256, prefix_cache_tokens=cache_tokens)
            forwards = []
            engine.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
            outs = await _serve(engine, jobs, together)
            await engine.close()
            return outs, dict(engine.stats), len(forwards)

        return run(main())

    outs, stats, forwards = outputs(4096)
    refs, off, off_forwards = outputs(0)
    _assert_same(outs, refs)
    assert stats["prefix_hits"] == 3 and stats["prefix_hit_tokens"] == 3 * (len(SYSTEM) + 1)
    assert forwards == stats["decode_steps"] + 1
    assert off_forwards == off["decode_steps"] + (1 if together else 4)


@pytest.mark.prefix_cache
def test_multi_turn_reuses_prompt_and_completion(tiny_model):
    turn1 = [*SYSTEM, 10, 11, 12]

    async def main() -> tuple[GenerateOutput, GenerateOutput, dict]:
        engine = LocalEngine(tiny_model, max_model_len=256)
        first = await engine.generate(turn1, GREEDY)
        before = dict(engine.stats)
        turn2 = turn1 + first.completion_ids + [20, 21, 22]
        second = await engine.generate(turn2, GREEDY)
        await engine.close()
        return first, second, {k: engine.stats[k] - before[k] for k in before}

    first, second, delta = run(main())
    # the finished turn-1 row cached prompt + completion but its last (never fed) token
    assert delta["prefix_hit_tokens"] == len(turn1) + len(first.completion_ids) - 1
    assert delta["prefill_tokens"] == 1 + 3
    turn2 = turn1 + first.completion_ids + [20, 21, 22]
    ref_ids, ref_lps = naive_greedy(tiny_model, turn2, GREEDY.max_tokens)
    assert second.completion_ids == ref_ids
    assert max(abs(a - b) for a, b in zip(second.logprobs, ref_lps, strict=True)) < 1e-4


@pytest.mark.prefix_cache
def test_weight_update_clears_prefix_cache(tiny_model):
    new_model = perturbed(tiny_model, seed=2)
    prompt = [*SYSTEM, 7, 8]
    params = SamplingParams(temperature=0.7, max_tokens=20, seed=4)

    async def main() -> tuple[GenerateOutput, GenerateOutput, int, int, dict]:
        engine = LocalEngine(tiny_model, max_model_len=256)
        old = await engine.generate(prompt, params)
        cached = engine.prefix_cache.tokens
        await engine.update_weights(new_model.state_dict(), 1)
        emptied = engine.prefix_cache.tokens + len(engine.prefix_cache.entries)
        new = await engine.generate(prompt, params)
        await engine.close()
        return old, new, cached, emptied, dict(engine.stats)

    old, new, cached, emptied, stats = run(main())
    assert cached == len(prompt) + len(old.completion_ids) - 1 and emptied == 0
    assert stats["prefix_hits"] == 0  # the second request did not reuse stale KV
    assert new.weight_versions == [1] * 20
    ref = teacher_forced(new_model, prompt, new.completion_ids, 0.7)
    assert max(abs(a - b) for a, b in zip(new.logprobs, ref, strict=True)) < 1e-4
    stale = teacher_forced(tiny_model, prompt, new.completion_ids, 0.7)
    assert max(abs(a - b) for a, b in zip(stale, ref, strict=True)) > 1e-2  # really new


def _kv(ids: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake one-layer KV (H = 1, L, D = 1) whose entries are the token ids."""
    t = torch.tensor(ids, dtype=torch.float32).view(1, -1, 1)
    return [(t, -t)]


def test_prefix_cache_lru_bound():
    assert common_prefix((1, 2, 3), (1, 2, 4, 5)) == 2 and common_prefix((1, 2), (1, 2, 3)) == 2
    cache = PrefixCache(max_tokens=10)
    for ids in [(1, 2, 3), (4, 5, 6, 7)]:
        cache.insert(ids, _kv(ids))
    n, kv = cache.lookup((1, 2, 3, 9))  # a hit marks (1, 2, 3) recently used
    assert n == 3 and kv[0][0].flatten().tolist() == [1, 2, 3]
    assert kv[0][1].flatten().tolist() == [-1, -2, -3]
    assert cache.lookup((4, 5, 6, 7))[0] == 3  # capped: one token is left to prefill
    assert cache.lookup((9, 9)) == (0, None)
    cache.lookup((1, 2))
    cache.insert((8, 9, 10, 11, 12), _kv((8, 9, 10, 11, 12)))  # 12 > 10: evict the LRU entry
    assert list(cache.entries) == [(1, 2, 3), (8, 9, 10, 11, 12)] and cache.tokens == 8
    cache.insert((1, 2, 3, 4), _kv((1, 2, 3, 4)))  # an extension replaces its prefix entry
    assert list(cache.entries) == [(8, 9, 10, 11, 12), (1, 2, 3, 4)] and cache.tokens == 9
    cache.insert((8, 9), _kv((8, 9)))  # covered by a longer entry: only touched
    assert list(cache.entries) == [(1, 2, 3, 4), (8, 9, 10, 11, 12)] and cache.tokens == 9
    cache.insert(tuple(range(11)), _kv(tuple(range(11))))  # larger than the bound: not kept
    assert cache.tokens == 9


@pytest.mark.prefix_cache
def test_engine_prefix_cache_stays_within_bound(tiny_model):
    prompts = [list(range(20 + 30 * i, 41 + 30 * i)) for i in range(3)]  # 21 disjoint tokens each

    async def main() -> list[tuple[int, ...]]:
        engine = LocalEngine(tiny_model, max_model_len=256, prefix_cache_tokens=50)
        outs = [await engine.generate(p, SamplingParams(0.0, max_tokens=5)) for p in prompts]
        keys = list(engine.prefix_cache.entries)
        assert engine.prefix_cache.tokens == 50 and engine.stats["prefix_hits"] == 0
        await engine.close()
        return [tuple(p + o.completion_ids[:-1]) for p, o in zip(prompts, outs, strict=True)], keys

    finished, keys = run(main())
    assert keys == finished[1:]  # 25 tokens each: the oldest was evicted


@pytest.mark.prefix_cache
def test_group_prefill_waves(tiny_model):
    """Newcomers sharing a long prefix: the first goes in this wave, its siblings wait for the
    next one (and then hit the cache); unrelated rows and cache-off engines use one wave."""
    from forgerl.engines.local.batcher import WAVE_MIN_SHARED
    from forgerl.engines.local.kv_batch import _Request

    def req(ids: list[int]) -> _Request:
        return _Request(ids, GREEDY, None, None, None)  # type: ignore[arg-type]

    a, b, c = req([*SYSTEM, 5]), req([*SYSTEM, 6, 7]), req([1, 2, 3])
    engine = LocalEngine(tiny_model, max_model_len=256)
    off = LocalEngine(tiny_model, max_model_len=256, prefix_cache_tokens=0)
    assert engine._next_wave([a, b, c]) == ([a, c], [b])
    assert off._next_wave([a, b, c]) == ([a, b, c], [])
    engine.prefix_cache.insert(tuple(SYSTEM), [])  # the shared part is cached: no wait
    assert engine._next_wave([a, b, c]) == ([a, b, c], [])
    engine.prefix_cache.clear()
    x, y = req([*SYSTEM[: WAVE_MIN_SHARED - 1], 8]), req([*SYSTEM[: WAVE_MIN_SHARED - 1], 9])
    assert engine._next_wave([x, y]) == ([x, y], [])  # too little shared to wait for
    z, w = req([*SYSTEM[:WAVE_MIN_SHARED], 8]), req([*SYSTEM[:WAVE_MIN_SHARED], 9])
    assert engine._next_wave([z, w]) == ([z], [w])
    run(engine.close())
    run(off.close())


def test_failed_prefill_fails_the_newcomers_only(tiny_model):
    """A newcomer whose prefill raises fails alone; the row already decoding runs to the end."""

    async def main() -> tuple[GenerateOutput, GenerateOutput]:
        engine = LocalEngine(tiny_model, max_model_len=512)
        prefill, calls = engine._prefill, []

        def flaky(rows):
            calls.append(len(rows))
            if len(calls) == 2:  # the second prefill: the newcomer joining a running batch
                calls.append(engine._batch is not None and len(engine._batch.rows))
                raise RuntimeError("prefill boom")
            return prefill(rows)

        engine._prefill = flaky
        long = await start_decoding(engine, [7, 8], 200)
        with pytest.raises(RuntimeError, match="prefill boom"):
            await engine.generate([1, 2, 3], GREEDY)
        again = await engine.generate([1, 2, 3], GREEDY)
        out = await long
        await engine.close()
        assert calls[:3] == [1, 1, 1]  # the failed prefill ran while one row was decoding
        return out, again

    out, again = run(main())
    assert out.finish_reason == "length"
    assert out.completion_ids == naive_greedy(tiny_model, [7, 8], 200)[0]
    assert again.completion_ids == naive_greedy(tiny_model, [1, 2, 3], GREEDY.max_tokens)[0]


def test_failed_merge_fails_both_batches_and_the_engine_serves_on(tiny_model, monkeypatch):
    """A merge that raises (e.g. out of memory for the padded KV caches) fails the running row
    and the newcomer, and the worker thread lives on."""
    from forgerl.engines.local import kv_batch as local

    def broken_merge(self, other):
        raise MemoryError("merge boom")

    async def main() -> GenerateOutput:
        engine = LocalEngine(tiny_model, max_model_len=512, prefix_cache_tokens=0)
        monkeypatch.setattr(local._Batch, "merge", broken_merge)
        long = await start_decoding(engine, [7, 8], 200)
        with pytest.raises(MemoryError, match="merge boom"):
            await asyncio.wait_for(engine.generate([1, 2, 3], GREEDY), timeout=10)
        with pytest.raises(MemoryError, match="merge boom"):
            await asyncio.wait_for(long, timeout=10)
        monkeypatch.undo()
        out = await asyncio.wait_for(engine.generate([1, 2, 3], GREEDY), timeout=10)
        await engine.close()
        return out

    out = run(main())
    assert out.completion_ids == naive_greedy(tiny_model, [1, 2, 3], GREEDY.max_tokens)[0]


def test_prefix_cache_option(tiny_model, request):
    """`pytest --prefix-cache off` (tests/conftest.py) reaches every engine, even one that asks."""
    off = request.config.getoption("prefix_cache") == "off"
    engine = LocalEngine(tiny_model, max_model_len=64, prefix_cache_tokens=100)
    assert engine.prefix_cache.max_tokens == (0 if off else 100)
    run(engine.close())


def test_requests_beyond_the_batch_limit_queue_and_are_counted(tiny_model):
    """CASES.md C20 at the engine: 5 requests at once with max_batch_size 2 all finish (none
    refused); 3 waited behind the configured limit, which the stats (and so the step metrics,
    as engine_max_batch_size / engine_queued_peak) show."""
    params = SamplingParams(temperature=0.0, max_tokens=64)  # no stop ids: 64 tokens each

    async def burst() -> tuple[list[GenerateOutput], dict]:
        engine = LocalEngine(tiny_model, max_model_len=256, max_batch_size=2)
        outs = await asyncio.gather(*[engine.generate([5, 6, i], params) for i in range(5)])
        await engine.close()
        return outs, engine.stats

    outs, stats = run(burst())
    assert [len(o.completion_ids) for o in outs] == [64] * 5
    assert (stats["max_batch_size"], stats["queued_peak"]) == (2, 3)


def test_kv_layer_grows_and_drops_rows_in_place():
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(4, 2, 5, 3, generator=g) for _ in "kv")  # (B, H, L, D)
    layer = _GrowingLayer()
    layer.update(k, v)
    buf = layer.keys.untyped_storage().data_ptr()
    step_k, step_v = (torch.randn(4, 2, 1, 3, generator=g) for _ in "kv")
    keys, values = layer.update(step_k, step_v)
    ref_k, ref_v = torch.cat([k, step_k], 2), torch.cat([v, step_v], 2)
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
    layer.keep([0, 2, 3], 2)  # row 1 finished; the first 2 columns are padding now
    ref_k, ref_v = ref_k[[0, 2, 3], :, 2:], ref_v[[0, 2, 3], :, 2:]
    assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v)
    step_k, step_v = (torch.randn(3, 2, 1, 3, generator=g) for _ in "kv")
    keys, values = layer.update(step_k, step_v)
    assert torch.equal(keys, torch.cat([ref_k, step_k], 2))
    assert torch.equal(values, torch.cat([ref_v, step_v], 2))
    assert keys.untyped_storage().data_ptr() == buf  # never reallocated
    # SPARE columns used up: one reallocation, same values
    more_k, more_v = (torch.randn(3, 2, _GrowingLayer.SPARE, 3, generator=g) for _ in "kv")
    keys2, _ = layer.update(more_k, more_v)
    assert keys2.untyped_storage().data_ptr() != buf
    assert torch.equal(keys2, torch.cat([keys, more_k], 2))
    # replaced from outside (as transformers' DynamicLayer would): keep gathers a copy
    layer.keys, layer.values = keys2.clone(), keys2.clone() + 1
    outside = layer.keys
    layer.keep([1], 1)
    assert torch.equal(layer.keys, outside[[1], :, 1:])
    assert torch.equal(layer.values, outside[[1], :, 1:] + 1)


def test_packed_linears_give_the_plain_logits(tiny_model):
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    with torch.no_grad():
        plain = tiny_model(ids).logits
        packed_model = copy.deepcopy(tiny_model)
        assert pack_linears(packed_model)
        packed = packed_model(ids).logits
        assert (packed - plain).abs().max() < 1e-5
        # the forward reads the packed copies: a weight change shows only after packing again
        for m in (tiny_model, packed_model):
            m.model.layers[0].mlp.down_proj.weight.add_(0.5)
        assert torch.equal(packed_model(ids).logits, packed)
        assert pack_linears(packed_model)
        changed = packed_model(ids).logits
        assert (changed - packed).abs().max() > 1e-2
        assert (changed - tiny_model(ids).logits).abs().max() < 1e-5
        bf16 = copy.deepcopy(tiny_model).to(torch.bfloat16)
        assert not pack_linears(bf16) and "forward" not in vars(bf16.lm_head)
    plain_engine = LocalEngine(tiny_model, max_model_len=64)
    engine = LocalEngine(tiny_model, max_model_len=64, packed_weights=True)
    try:
        assert engine._packed and "forward" in vars(engine.model.lm_head)
        assert not plain_engine._packed and "forward" not in vars(plain_engine.model.lm_head)
    finally:
        asyncio.run(engine.close())
        asyncio.run(plain_engine.close())


def test_engine_sdpa_folds_one_token_queries_onto_their_kv_heads(tiny_model):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    layer = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q = torch.randn(5, 6, 1, 8)  # (B, H, 1, D): 6 query heads over 2 key/value heads
    buf_k, buf_v = torch.randn(5, 2, 20, 8), torch.randn(5, 2, 20, 8)
    k, v = buf_k[:, :, 3:14], buf_v[:, :, 2:13]  # strided views, as the decode cache hands out
    scores = q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.3  # head h reads kv head h // 3
    naive = (torch.softmax(scores, -1) @ v.repeat_interleave(3, 1)).transpose(1, 2)  # (B, 1, H, D)
    out, weights = engine_sdpa(layer, q, k, v, None, scaling=0.3, dropout=0.0)
    assert out.shape == (5, 1, 6, 8) and weights is None
    assert (out - naive).abs().max() < 1e-6
    half, _ = engine_sdpa(layer, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=0.3)
    assert half.dtype == torch.bfloat16 and (half.float() - naive).abs().max() < 3e-2
    mask = torch.ones(5, 1, 1, 11, dtype=torch.bool)
    mask[0, ..., :4] = False  # a padded row: transformers' own path
    masked, _ = engine_sdpa(layer, q, k, v, mask, scaling=0.3)
    assert torch.equal(masked, sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)[0])
    assert (masked[1:] - naive[1:]).abs().max() < 1e-6
    engine = LocalEngine(tiny_model, max_model_len=64)
    try:
        assert engine.model.config._attn_implementation == ENGINE_SDPA
        assert tiny_model.config._attn_implementation == "sdpa"
    finally:
        asyncio.run(engine.close())
