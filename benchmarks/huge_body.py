"""A chat body far over max_model_len: refused untokenized vs tokenizing it first, same run.

Run: `.venv/bin/python benchmarks/huge_body.py [--mb 6]` (a few seconds per MB on 2 cores).

A real gateway (`Gateway.serve`, byte tokenizer, max_model_len 1024, an engine that is never
reached, recording into a real SQLitePool) gets one POST /v1/chat/completions whose user message
is `--mb` MB of text, and, 0.3 s later, a GET /v1/models (it waits for the refusal only when
that takes longer). The gateway refuses the body with a
400 `context_length_exceeded` before tokenizing it (`core.refuse_surely_too_long`). The baseline
is what the gateway did before: `Renderer.encode` of the same text (the tokenizer call that held
the event loop), timed in this process after the gateway part, so its memory (the process's
peak RSS, `ru_maxrss`) is measured after the gateway's. Prints one table with the ratios.

Measured here with --mb 60 before the change (the old gateway, same script shape): refusal after
87.2 s, GET /v1/models answered after 86.3 s, peak 12.0 GiB; after: 0.65 s, 0.03 s, 0.71 GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import threading
import time
from pathlib import Path

import httpx

from forgerl.datapool.sqlite import SQLitePool
from forgerl.gateway.app import Gateway
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.models import build_byte_tokenizer


class NeverEngine:
    """A rollout engine the refused call must never reach."""

    max_model_len, weight_version, stats = 1024, 0, {}

    async def generate(self, prompt_ids, params):
        raise AssertionError("the huge body reached the engine")


def peak_gib() -> float:
    """This process's peak RSS so far, GiB (`ru_maxrss`, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=6.0, help="size of the message, MB")
    args = parser.parse_args()
    text = "x" * int(args.mb * 1e6)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}]})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    renderer = ChatMLRenderer(build_byte_tokenizer())
    with tempfile.TemporaryDirectory() as tmp:
        pool = SQLitePool(Path(tmp) / "pool.sqlite")
        gateway = Gateway(renderer, NeverEngine(), pool, model_name="tiny")
        server = asyncio.run_coroutine_threadsafe(gateway.serve("127.0.0.1", 0), loop).result(30)
        _, key = gateway.open_session(task_index=0)
        result: dict[str, float] = {}

        def post() -> None:
            t = time.perf_counter()
            r = httpx.post(f"{server.base_url}/chat/completions", content=body, timeout=600,
                           headers={"Authorization": f"Bearer {key}",
                                    "Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            result["refused"] = time.perf_counter() - t

        poster = threading.Thread(target=post)
        poster.start()
        time.sleep(0.3)
        t = time.perf_counter()
        assert httpx.get(f"{server.base_url}/models", timeout=600).status_code == 200
        models = time.perf_counter() - t
        poster.join()
        gateway_peak = peak_gib()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        pool.close()
    t = time.perf_counter()
    n = len(renderer.encode(text))
    encode = time.perf_counter() - t
    encode_peak = peak_gib()
    print(f"\n{args.mb:g} MB user message, max_model_len 1024 ({n:,} tokens once tokenized)\n")
    print(f"| {'':44} | {'refused untokenized':>19} | {'tokenized (before)':>18} | {'ratio':>7} |")
    print(f"|{'-' * 46}|{'-' * 21}|{'-' * 20}|{'-' * 9}|")
    print(f"| {'seconds to the refusal / to tokenize':44} | {result['refused']:19.2f} | "
          f"{encode:18.2f} | {encode / result['refused']:6.0f}x |")
    print(f"| {'GET /v1/models sent 0.3 s after the body (s)':44} | {models:19.3f} | "
          f"{'not measured':>18} | {'':>7} |")
    print(f"| {'process peak RSS (GiB)':44} | {gateway_peak:19.2f} | {encode_peak:18.2f} | "
          f"{encode_peak / gateway_peak:6.1f}x |")


if __name__ == "__main__":
    main()
