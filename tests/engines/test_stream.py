"""LocalEngine.stream: tokens reach the consumer while decoding goes on, and add up to generate().

Pinned here, on the tiny random Llama from tests/conftest.py (fp32, CPU):
- The streamed TokenEvents concatenated equal the stream's closing GenerateOutput and what
  generate() returns for the same request, bit for bit (ids, logprobs, weight_versions,
  finish_reason), for greedy, seeded sampling and a stop id; greedy equals the naive loop.
- Each token arrives before the engine runs its next forward (a gated forward proves it), with
  sampled_at no later than its arrival.
- Concurrent streams decode in one batch; each equals its request run alone.
- Closing the iterator or cancelling its consumer mid-stream frees the only batch slot (the next
  request runs), and the consumer never gets a GenerateOutput; closing the engine ends a stream
  with "abort" holding exactly the streamed tokens.
- A weight update mid-stream shows in the per-token versions (0…0 1…1) and logprobs.
- A bad request raises from the first __anext__; a failed forward raises through the stream.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from forgerl.engines.base import TokenEvent
from forgerl.engines.local import LocalEngine
from forgerl.types import GenerateOutput, SamplingParams

from .test_local import GREEDY, _alone, naive_greedy, perturbed, run, teacher_forced


async def collect(events) -> tuple[list[TokenEvent], GenerateOutput]:
    """All TokenEvents of a stream and its closing GenerateOutput (asserting that shape)."""
    *tokens, out = [item async for item in events]
    assert all(isinstance(t, TokenEvent) for t in tokens) and isinstance(out, GenerateOutput)
    return tokens, out


def joined(tokens: list[TokenEvent], finish_reason: str) -> GenerateOutput:
    """The completion the events spell out."""
    return GenerateOutput(
        [t.token_id for t in tokens],
        [t.logprob for t in tokens],
        [t.weight_version for t in tokens],
        finish_reason,  # type: ignore[arg-type]
    )


PROMPT = [1, 33, 34]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "stop"])
def test_streamed_equals_generated(tiny_model, kind):
    ref_ids, ref_lps = naive_greedy(tiny_model, PROMPT, 12)
    params = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=12),
        "seeded": SamplingParams(temperature=0.8, max_tokens=40, seed=3),
        "stop": SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(ref_ids[6],)),
    }[kind]

    async def main() -> tuple[list[TokenEvent], GenerateOutput, GenerateOutput]:
        # no prefix cache: the second request recomputes the same prompt KV bit for bit
        engine = LocalEngine(tiny_model, max_model_len=256, prefix_cache_tokens=0)
        tokens, streamed = await collect(engine.stream(PROMPT, params))
        generated = await engine.generate(PROMPT, params)
        await engine.close()
        return tokens, streamed, generated

    tokens, streamed, generated = run(main())
    assert joined(tokens, streamed.finish_reason) == streamed == generated
    if params.temperature == 0:
        cut = ref_ids.index(ref_ids[6]) + 1 if kind == "stop" else 12
        assert streamed.completion_ids == ref_ids[:cut]
        assert streamed.logprobs == pytest.approx(ref_lps[:cut], abs=1e-4)
        assert streamed.finish_reason == ("stop" if kind == "stop" else "length")
    else:
        ref = teacher_forced(tiny_model, PROMPT, streamed.completion_ids, params.temperature)
        assert streamed.logprobs == pytest.approx(ref, abs=1e-4)
        assert len(set(streamed.completion_ids)) > 5  # really sampled
    assert streamed.weight_versions == [0] * len(tokens)


def test_each_token_arrives_before_the_next_forward(tiny_model):
    """The forward waits for a permit that only a delivered token releases: a stream that held
    tokens back until the end would starve it (RuntimeError through the stream)."""
    n = 30

    async def main() -> tuple[list[TokenEvent], list[float], GenerateOutput]:
        engine = LocalEngine(tiny_model, max_model_len=256)
        forward, permits = engine.model.forward, threading.Semaphore(1)  # 1: the prefill

        def gated(*args, **kwargs):
            if not permits.acquire(timeout=10):
                raise RuntimeError("the previous token was not delivered")
            return forward(*args, **kwargs)

        engine.model.forward = gated
        tokens, arrived = [], []
        async for item in engine.stream([5, 6, 7], SamplingParams(0.0, max_tokens=n)):
            if isinstance(item, TokenEvent):
                arrived.append(time.perf_counter())
                tokens.append(item)
                permits.release()
            else:
                out = item
        await engine.close()
        return tokens, arrived, out

    tokens, arrived, out = run(main())
    assert joined(tokens, "length") == out
    assert out.completion_ids == naive_greedy(tiny_model, [5, 6, 7], n)[0]
    assert all(t.sampled_at <= a for t, a in zip(tokens, arrived, strict=True))
    assert all(a.sampled_at < b.sampled_at for a, b in itertools.pairwise(tokens))


def test_concurrent_streams_share_a_batch(tiny_model):
    prompts = [[5, 6, 7], list(range(10, 40)), [100], list(range(50, 62))]
    params = [
        SamplingParams(0.0, max_tokens=40),
        SamplingParams(0.7, max_tokens=50, seed=3),
        SamplingParams(1.3, max_tokens=45, seed=11),
        SamplingParams(0.0, max_tokens=60),
    ]

    async def main() -> tuple[list[tuple[list[TokenEvent], GenerateOutput]], int]:
        engine = LocalEngine(tiny_model, max_model_len=256, max_batch_size=4)
        widest = 0

        async def consume(prompt, p) -> tuple[list[TokenEvent], GenerateOutput]:
            nonlocal widest
            tokens = []
            async for item in engine.stream(prompt, p):
                batch = engine._batch
                widest = max(widest, len(batch.rows) if batch else 0)
                if isinstance(item, GenerateOutput):
                    return tokens, item
                tokens.append(item)
            raise AssertionError("the stream ended without a GenerateOutput")

        jobs = zip(prompts, params, strict=True)
        outs = await asyncio.gather(*[consume(pr, p) for pr, p in jobs])
        await engine.close()
        return outs, widest

    outs, widest = run(main())
    assert widest == 4  # the four rows decoded together
    for (tokens, out), prompt, p in zip(outs, prompts, params, strict=True):
        assert joined(tokens, "length") == out
        alone = run(_alone(tiny_model, prompt, p))
        assert out.completion_ids == alone.completion_ids
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_cancel_mid_stream_frees_the_slot(tiny_model, how):
    """One slot: a 4000-token stream abandoned after 3 tokens leaves the batch at the end of the
    next decode step (at most one more token), and the next requests run."""

    async def main() -> tuple[list, int, int, GenerateOutput, GenerateOutput]:
        engine = LocalEngine(tiny_model, max_model_len=4096, max_batch_size=1)
        events, received = engine.stream([4, 5], SamplingParams(0.0, max_tokens=4000)), []

        async def consume() -> None:
            async for item in events:
                received.append(item)

        if how == "aclose":
            received = [await anext(events) for _ in range(3)]
            (row,) = engine._batch.rows  # the worker's record of this request
            await events.aclose()
        else:
            task = asyncio.create_task(consume())
            while len(received) < 3:
                await asyncio.sleep(0.001)
            (row,) = engine._batch.rows
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        left_at = len(row.completion_ids)
        first = await asyncio.wait_for(engine.generate([1, 2, 3], GREEDY), timeout=10)
        second = await asyncio.wait_for(engine.generate([9, 8], GREEDY), timeout=10)
        await engine.close()
        return received, left_at, len(row.completion_ids), first, second

    received, left_at, decoded, first, second = run(main())
    assert decoded <= left_at + 1
    assert received and all(isinstance(item, TokenEvent) for item in received)  # no output
    ids = [t.token_id for t in received]
    assert ids == naive_greedy(tiny_model, [4, 5], len(ids))[0] and len(ids) < 4000
    assert first.completion_ids == naive_greedy(tiny_model, [1, 2, 3], GREEDY.max_tokens)[0]
    assert second.completion_ids == naive_greedy(tiny_model, [9, 8], GREEDY.max_tokens)[0]


def test_engine_close_ends_a_stream_with_abort(tiny_model):
    async def main() -> tuple[list[TokenEvent], GenerateOutput]:
        engine = LocalEngine(tiny_model, max_model_len=4096)
        tokens, closing = [], None
        async for item in engine.stream([7, 8], SamplingParams(0.0, max_tokens=4000)):
            if isinstance(item, GenerateOutput):
                out = item
            else:
                tokens.append(item)
            if len(tokens) == 5 and closing is None:
                closing = asyncio.create_task(engine.close())
        await closing
        return tokens, out

    tokens, out = run(main())
    assert out.finish_reason == "abort" and joined(tokens, "abort") == out
    assert 5 <= len(tokens) < 4000
    assert out.completion_ids == naive_greedy(tiny_model, [7, 8], len(tokens))[0]


def test_weight_update_mid_stream(tiny_model):
    new_model = perturbed(tiny_model, seed=1)
    prompt, t = [1, 50, 51, 52], 0.7

    async def main() -> tuple[list[TokenEvent], GenerateOutput]:
        engine = LocalEngine(tiny_model, max_model_len=1024)
        tokens = []
        async for item in engine.stream(prompt, SamplingParams(t, max_tokens=200, seed=5)):
            if isinstance(item, GenerateOutput):
                out = item
                break
            tokens.append(item)
            if len(tokens) == 3:  # the engine decodes on while the update waits for a step
                await engine.update_weights(new_model.state_dict(), 1)
        await engine.close()
        return tokens, out

    tokens, out = run(main())
    assert joined(tokens, "length") == out
    k = out.weight_versions.index(1)
    assert k >= 3 and out.weight_versions == [0] * k + [1] * (200 - k)
    old = teacher_forced(tiny_model, prompt, out.completion_ids, t)
    new = teacher_forced(new_model, prompt, out.completion_ids, t)
    assert out.logprobs[:k] == pytest.approx(old[:k], abs=1e-4)
    assert out.logprobs[k:] == pytest.approx(new[k:], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(new[k:], old[k:], strict=True)) > 1e-2  # really new


def test_stream_errors(tiny_model):
    async def main() -> GenerateOutput:
        engine = LocalEngine(tiny_model, max_model_len=64)
        with pytest.raises(ValueError, match="max_model_len"):
            await anext(engine.stream([5] * 60, SamplingParams(max_tokens=5)))
        forward = engine.model.forward

        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        engine.model.forward = broken
        with pytest.raises(RuntimeError, match="boom"):
            await collect(engine.stream([1, 2, 3], GREEDY))
        engine.model.forward = forward
        _, out = await collect(engine.stream([1, 2, 3], SamplingParams(0.0, max_tokens=5)))
        await engine.close()
        return out

    out = run(main())
    assert out.completion_ids == naive_greedy(tiny_model, [1, 2, 3], 5)[0]
