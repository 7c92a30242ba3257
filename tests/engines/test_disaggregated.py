"""Prefill/decode disaggregation: `DisaggregatedEngine` (a prefill process and a decode process,
real OS processes) keeps the `RolloutEngine` contract and LocalEngine's outputs.

Pinned here, on the tiny random Llama (fp32, CPU):
- The seam: KV offered through `LocalEngine.insert_prefix` under the engine's weight version
  lets a request extending it by one token run no prefill forward, with the cold engine's ids
  and logprobs; offered under another version it is dropped (counted), and the request
  prefills its whole prompt.
- Greedy and seeded completions (prompts of 1 to 298 tokens, sent together) equal a single
  LocalEngine's ids exactly and its logprobs within 1e-5; the streamed events add up to the
  output; the decode process reused exactly prompt[:-1] of each request from the hand-off.
- A full weight update mid-stream shows in the versions (0…0 1…1) and the later logprobs are
  the new weights' teacher-forced ones; a delta update moves both processes to the next
  version; a delta against another base raises DeltaMismatch and the version stays.
- Hand-offs prefilled before an update are never attended (dropped as stale, or cleared by
  the update): the decode engine prefills those prompts itself, and every output after the
  update is the new weights' teacher-forced one.
- Closing a stream mid-way frees its decode row (it stops decoding at once); closing the engine
  ends an in-flight stream with "abort" and later calls raise RuntimeError.
- SIGKILL of either worker process ends an in-flight stream with a RuntimeError naming it (no
  hang), and later generate / update_weights raise it too.
- Config: `[engine] disaggregated` needs prefix_cache_tokens >= model.max_model_len and the
  local cluster backend; a two-step training run on it syncs weights to both processes.
- vLLM's KV-transfer settings reach its engine arguments and its server flags.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from forgerl.config import ConfigError
from forgerl.engines.disaggregated import DisaggregatedEngine
from forgerl.engines.local import LocalEngine
from forgerl.engines.remote import kv_transfer_flags
from forgerl.models import build_tiny_model
from forgerl.types import GenerateOutput, SamplingParams
from forgerl.weights import DeltaMismatch, checksum, make_delta, unique_tensors

from .test_local import perturbed, run, teacher_forced
from .test_stream import collect, joined

PROMPTS = [[7], [1, 40, 41], [1, *range(60, 110)], [1, *range(3, 250), *range(3, 53)]]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine():
    eng = DisaggregatedEngine(build_tiny_model(), max_model_len=512, max_batch_size=4,
                              prefix_cache_tokens=4096)
    yield eng
    run(eng.close())


async def _local(model, params: SamplingParams) -> list[GenerateOutput]:
    local = LocalEngine(model, max_model_len=512)
    try:
        return list(await asyncio.gather(*(local.generate(p, params) for p in PROMPTS)))
    finally:
        await local.close()


def test_insert_prefix_joins_decode_without_prefill_and_drops_stale_kv(tiny_model):
    prompt, params = [1, *range(20, 60)], SamplingParams(0.0, max_tokens=8)

    async def main():
        donor = LocalEngine(tiny_model, max_model_len=256)
        ref = await donor.generate(prompt, params)
        kv = donor.prefix_cache.lookup(tuple(prompt))[1]  # the KV of prompt[:-1]
        await donor.close()
        outs = []
        for version in (0, 5):
            eng = LocalEngine(tiny_model, max_model_len=256)
            eng.insert_prefix(prompt[:-1], kv, version)
            outs.append((await eng.generate(prompt, params), dict(eng.stats)))
            await eng.close()
        return ref, outs

    ref, ((fresh, fresh_stats), (stale, stale_stats)) = run(main())
    assert fresh == ref and stale.completion_ids == ref.completion_ids
    # only the last prompt token is new: it rides the next decode step (no prefill forward)
    assert fresh_stats["prefill_tokens"] == 1 and fresh_stats["prefix_hit_tokens"] == 40
    assert fresh_stats["handoffs_stale"] == 0
    assert stale_stats["handoffs_stale"] == 1 and stale_stats["prefill_tokens"] == 41
    assert stale_stats["prefix_hit_tokens"] == 0


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_outputs_equal_a_single_local_engine(engine, tiny_model, kind):
    params = {"greedy": SamplingParams(0.0, max_tokens=30),
              "seeded": SamplingParams(0.9, max_tokens=30, seed=11, top_k=50,
                                       repetition_penalty=1.2)}[kind]
    before = dict(engine.stats)

    async def main():
        streams = await asyncio.gather(*(collect(engine.stream(p, params)) for p in PROMPTS))
        return streams, await _local(tiny_model, params)

    streams, refs = run(main())
    for (tokens, out), ref in zip(streams, refs, strict=True):
        assert out == joined(tokens, out.finish_reason)
        assert out.completion_ids == ref.completion_ids and out.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs, strict=True)) < 1e-5
        assert out.weight_versions == [0] * 30
    delta = {k: engine.stats[k] - before.get(k, 0) for k in engine.stats}
    assert delta["handoffs"] == 3  # the one-token prompt has no prefix to hand over
    assert delta["handoff_tokens"] == sum(len(p) - 1 for p in PROMPTS) == 349
    assert delta["prefix_hit_tokens"] == 349  # each request reused exactly prompt[:-1]
    assert delta["prefill_tokens"] <= len(PROMPTS)  # the last prompt tokens at most
    assert delta["handoff_bytes"] == 349 * 2 * 2 * 2 * 16 * 4  # layers, k/v, heads, dim, fp32


def test_full_and_delta_updates_reach_both_processes(engine, tiny_model):
    v1, v2 = perturbed(tiny_model, seed=1), perturbed(tiny_model, seed=2)
    prompt, t = [1, 50, 51, 52], 0.7

    async def main():
        stream = engine.stream(prompt, SamplingParams(t, max_tokens=200, seed=5))
        tokens = [await anext(stream) for _ in range(3)]
        await engine.update_weights(v1.state_dict(), 1)
        tokens, out = await collect(_chain(tokens, stream))
        base = unique_tensors(v1.state_dict())
        delta, _ = make_delta(base, {k: checksum(v) for k, v in base.items()},
                              unique_tensors(v2.state_dict()), 1)
        await engine.apply_delta(delta, 2)
        after = await engine.generate(PROMPTS[2], SamplingParams(0.0, max_tokens=10))
        with pytest.raises(DeltaMismatch):
            await engine.apply_delta(delta, 3)  # its base is version 1
        version = engine.weight_version
        await engine.update_weights(tiny_model.state_dict(), 3)  # back, for the later tests
        return out, after, version

    out, after, version = run(main())
    k = out.weight_versions.index(1)
    assert k >= 3 and out.weight_versions == [0] * k + [1] * (200 - k)
    new = teacher_forced(v1, prompt, out.completion_ids, t)
    assert max(abs(a - b) for a, b in zip(out.logprobs[k:], new[k:], strict=True)) < 1e-4
    ref = teacher_forced(v2, PROMPTS[2], after.completion_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(after.logprobs, ref, strict=True)) < 1e-4
    assert after.weight_versions == [2] * 10 and version == 2


async def _chain(first, rest):
    for item in first:
        yield item
    async for item in rest:
        yield item


def test_handoffs_built_before_an_update_are_never_used(engine, tiny_model):
    v4 = perturbed(tiny_model, seed=4)
    prompts = [[1, *((i + j) % 250 + 3 for j in range(300))] for i in range(8)]
    params = SamplingParams(0.0, max_tokens=4)
    before = engine.stats["prefill_tokens"]

    async def main():
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in prompts]
        await asyncio.sleep(0)  # the requests are on their way to the prefill process
        await engine.update_weights(v4.state_dict(), 4)
        outs = await asyncio.gather(*tasks)
        await engine.update_weights(tiny_model.state_dict(), 5)
        return outs

    outs = run(main())
    for p, out in zip(prompts, outs, strict=True):
        assert out.weight_versions == [4] * 4
        ref = teacher_forced(v4, p, out.completion_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)) < 1e-4
    # no request attended a hand-off built by the old weights: each was dropped as stale (its
    # version) or cleared by the update, and the decode engine prefilled the prompt itself
    assert engine.stats["prefill_tokens"] - before >= sum(len(p) - 1 for p in prompts)


def test_closing_a_stream_frees_its_decode_row(engine):
    async def main():
        before = engine.stats["decode_rows"]
        stream = engine.stream([1, 2, 3], SamplingParams(0.0, max_tokens=480))
        for _ in range(3):
            await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0.5)
        await engine.generate([1, 9], SamplingParams(0.0, max_tokens=2))  # refreshes the stats
        return engine.stats["decode_rows"] - before

    assert run(main()) < 60  # 480 rows if the closed stream had kept decoding


@pytest.mark.parametrize("worker", ["prefill", "decode"])
def test_a_killed_worker_fails_requests_with_a_clear_error(tiny_model, worker):
    async def main():
        eng = DisaggregatedEngine(tiny_model, max_model_len=512, prefix_cache_tokens=512)
        try:
            stream = eng.stream([1, 2, 3], SamplingParams(0.0, max_tokens=500))
            await anext(stream)
            pid = eng._procs[worker].pid
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(RuntimeError) as info:
                await asyncio.wait_for(collect(stream), 30)
            with pytest.raises(RuntimeError, match="died"):
                await eng.generate([1, 2], SamplingParams(0.0, max_tokens=2))
            with pytest.raises(RuntimeError, match="died"):
                await eng.update_weights(tiny_model.state_dict(), 1)
            return str(info.value), pid
        finally:
            await eng.close()

    message, pid = run(main())
    assert message == f"DisaggregatedEngine: the {worker} worker process (pid {pid}) died, " \
                      "exit code -9"


def test_close_aborts_in_flight_streams_and_later_calls_raise(engine):
    # the module's last test: it closes the shared engine
    async def main():
        stream = engine.stream([1, 2, 3], SamplingParams(0.0, max_tokens=480))
        tokens = [await anext(stream) for _ in range(2)]
        closing = asyncio.create_task(engine.close())
        rest, out = await asyncio.wait_for(collect(stream), 30)
        await closing
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate([1, 2], SamplingParams(0.0, max_tokens=2))
        return tokens + rest, out

    tokens, out = run(main())
    assert out.finish_reason == "abort" and out == joined(tokens, "abort")
    assert 2 <= len(out.completion_ids) < 480


def test_config_checks(tmp_path):
    from tests.test_controller import tiny_config

    assert not tiny_config(tmp_path).engine.disaggregated
    with pytest.raises(ConfigError, match="prefix_cache_tokens"):
        tiny_config(tmp_path, "--engine.disaggregated", "true", "--engine.prefix_cache_tokens",
                    "100")
    with pytest.raises(ConfigError, match=r"cluster\.backend"):
        tiny_config(tmp_path, "--engine.disaggregated", "true", "--cluster.backend", "ray")
    for flag, value in [("--engine.speculative_tokens", "2"), ("--engine.kv_pool", "process")]:
        with pytest.raises(ConfigError, match="speculative_tokens = 0 and kv_pool"):
            tiny_config(tmp_path, "--engine.disaggregated", "true", flag, value)


def test_moe_models_are_refused_by_the_engines_that_carry_no_routes():
    """A hand-off and a pool block carry KV but not the prompt's routed experts (R3)."""
    from forgerl.engines.kv_pool import KVPool
    from forgerl.models import build_tiny_moe

    moe = build_tiny_moe()
    with pytest.raises(ValueError, match="does not serve MoE models"):
        DisaggregatedEngine(moe, max_model_len=64, prefix_cache_tokens=64)
    with pytest.raises(ValueError, match="kv_pool is not supported for a MoE model"):
        LocalEngine(moe, max_model_len=64, kv_pool=KVPool(2**20))


def test_two_training_steps_on_a_disaggregated_engine(tmp_path):
    from forgerl.controller import start_services
    from tests.test_controller import make_agent, sync, tiny_config

    @sync
    async def main():
        config = tiny_config(tmp_path / "run", "--engine.disaggregated", "true")
        async with start_services(config, make_agent()) as s:
            assert isinstance(s.engine, DisaggregatedEngine)
            for _ in range(2):
                s.admit()
                batch = await s.next_batch()
                await s.train(batch)
                await s.sync_weights()
            group = s.pool.get_group(batch[0])
            versions = [v for t in group.trajectories for c in t.completions
                        for v in c.weight_versions]
            return s.engine.weight_version, s.engine.stats, versions

    version, stats, versions = main()
    assert version == 2 and stats["handoffs"] > 0 and stats["handoffs_stale"] >= 0
    assert versions and set(versions) <= {0, 1}


def test_vllm_kv_transfer_settings_are_passed_through():
    settings = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert kv_transfer_flags(None) == []
    assert kv_transfer_flags(settings) == ["--kv-transfer-config", json.dumps(settings)]
    vllm_py = ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_py.exists():
        pytest.skip("no .venv-vllm (scripts/setup_vllm.sh): vLLM's engine args not checked")
    code = ("import json, sys; from forgerl.engines.vllm import engine_args; "
            "a = engine_args('m', 256, 'float32', 1.0, 8, 0, json.loads(sys.argv[1])); "
            "b = engine_args('m', 256, 'float32', 1.0, 8, 0); "
            "print(json.dumps([a.kv_transfer_config.kv_connector, a.kv_transfer_config.kv_role,"
            " b.kv_transfer_config]))")
    done = subprocess.run([str(vllm_py), "-c", code, json.dumps(settings)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["NixlConnector", "kv_both", None]
