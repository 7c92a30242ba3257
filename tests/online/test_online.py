"""Online RL from production traffic on the tiny model, over real HTTP (openai SDK, httpx) with
real engines, trainer and a real SQLite file.

Pins: unconsented sessions are answered and never in the pool; late feedback becomes the
stored reward (a second is 409 and changes nothing, an unknown id 404); a call holding an
e-mail or phone number is answered and never stored, a clean one is; the held-out gate sends a
better hand-built candidate to the canary and rejects a worse one (the trainer back on the
incumbent's weights); the canary takes its share of sessions and their calls record its
version (streamed and Anthropic calls too); a regressing canary is rolled back (calls record
the old version again), a good one promoted, and a restart serves the last promoted version; a
poisoned batch of feedback makes a candidate that the gate rejects; traffic older than
max_off_policy_steps is dropped, never trained.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from forgerl.config import OnlineConfig
from forgerl.datapool.sqlite import SQLitePool
from forgerl.gateway.conversation import Message
from forgerl.gateway.renderers.templates import build_renderer
from forgerl.models import build_byte_tokenizer, build_tiny_model
from forgerl.online.canary import CanaryEngine
from forgerl.online.privacy import PrivatePool, regex_scrub
from forgerl.online.serve import start_online
from forgerl.online.service import HeldOut
from forgerl.trainer.samples import TrainingSample
from forgerl.trainer.trainer import Trainer
from forgerl.types import Completion

ADMIN = "sk-admin-test"
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "online.py"


def lowercase(_task: dict, text: str) -> float:
    return sum("a" <= ch <= "z" for ch in text) / max(len(text), 1)


HELD_OUT = HeldOut([{"question": q} for q in ("hi", "go on", "say something")], lowercase,
                   max_tokens=16, samples=8, seed=7)


@asynccontextmanager
async def online(tmp_path, **config):
    torch.manual_seed(0)
    svc = await start_online(build_tiny_model(), build_byte_tokenizer(), tmp_path,
                             OnlineConfig(**config), HELD_OUT, ADMIN, lr=1e-2,
                             max_model_len=256, background=False, device="cpu")
    http = httpx.AsyncClient(base_url=svc.server.base_url.removesuffix("/v1"),
                             headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60,
                             limits=httpx.Limits(max_keepalive_connections=0))
    try:
        yield svc, http
    finally:
        await http.aclose()
        await svc.close()


async def chat(svc, api_key: str, text: str, seed: int = 0) -> tuple[str, int]:
    """One call with the openai SDK: (reply text, x-forgerl-weight-version)."""
    client = AsyncOpenAI(base_url=svc.server.base_url, api_key=api_key, max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="policy", messages=[{"role": "user", "content": text}], max_tokens=8, seed=seed)
    await client.close()
    return raw.parse().choices[0].message.content or "", int(
        raw.headers["x-forgerl-weight-version"])


def stored(tmp_path) -> dict[str, list]:
    """Trajectory id → its completions, read from the SQLite file by a fresh connection."""
    pool = SQLitePool(tmp_path / "pool.sqlite")
    try:
        return {t.id: t for i in pool.task_indices() for t in pool.get_group(i).trajectories}
    finally:
        pool.close()


def test_consent_respected(tmp_path):
    async def main():
        async with online(tmp_path) as (svc, http):
            yes = (await http.post("/v1/online/sessions", json={"consent": True})).json()
            header = (await http.post("/v1/online/sessions",
                                      headers={"X-ForgeRL-Consent": "true"})).json()
            no = (await http.post("/v1/online/sessions",
                                  headers={"X-ForgeRL-Consent": "false"})).json()
            default = (await http.post("/v1/online/sessions")).json()
            bad = await http.post("/v1/online/sessions", headers={"X-ForgeRL-Consent": "maybe"})
            for s in (yes, header, no, default):
                assert (await chat(svc, s["api_key"], "hello"))[1] == 0
            spec = (await http.get("/openapi.json")).json()
            body = spec["paths"]["/v1/online/feedback"]["post"]["requestBody"]
            assert body["content"]["application/json"]["schema"]["$ref"].endswith(
                "FeedbackRequest")
            assert "/v1/chat/completions" in spec["paths"]
            return yes, header, no, default, bad, svc.service.pool.counters
    yes, header, no, default, bad, counters = asyncio.run(main())
    assert [s["consent"] for s in (yes, header, no, default)] == [True, True, False, False]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-ForgeRL-Consent"
    rows = stored(tmp_path)
    assert set(rows) == {yes["session_id"], header["session_id"]}
    assert all(len(t.completions) == 1 and t.completions[0].weight_version == 0
               for t in rows.values())
    assert counters["unconsented_calls"] == 2


def test_feedback_lands_as_reward(tmp_path):
    async def main():
        async with online(tmp_path) as (svc, http):
            a = (await http.post("/v1/online/sessions", json={"consent": True})).json()
            b = (await http.post("/v1/online/sessions", json={"consent": True})).json()
            n = (await http.post("/v1/online/sessions", json={"consent": False})).json()
            for s in (a, b, n):
                await chat(svc, s["api_key"], "hello")
            await asyncio.sleep(0.5)  # later
            r = [await http.post("/v1/online/feedback", json=body) for body in (
                {"session_id": a["session_id"], "score": -0.5},
                {"session_id": b["session_id"], "outcome": "success"},
                {"session_id": n["session_id"], "score": 1.0},
                {"session_id": a["session_id"], "score": 1.0},
                {"session_id": "nope", "score": 1.0},
                {"session_id": b["session_id"], "score": 2.0},
                {"session_id": b["session_id"], "score": 1.0, "outcome": "failure"})]
            after = await chat_after(svc, a["api_key"])
            return a, b, r, after
    a, b, r, after = asyncio.run(main())
    assert [x.status_code for x in r] == [200, 200, 200, 409, 404, 400, 400]
    assert r[2].json() == {"session_id": r[2].json()["session_id"], "reward": 1.0,
                           "stored": False}
    assert r[3].json()["error"]["code"] == "feedback_exists"
    assert r[4].json()["error"]["code"] == "session_not_found"
    rows = stored(tmp_path)
    assert (rows[a["session_id"]].status, rows[a["session_id"]].reward) == ("finished", -0.5)
    assert rows[b["session_id"]].reward == 1.0 and len(rows) == 2
    assert after == 401  # feedback closed the session


async def chat_after(svc, api_key: str) -> int:
    async with httpx.AsyncClient(base_url=svc.server.base_url) as c:
        r = await c.post("/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                         json={"model": "policy", "messages": [{"role": "user", "content": "x"}]})
        return r.status_code


def test_regex_scrub():
    assert regex_scrub("mail jane.doe+x@mail.example.org now") == "mail [email] now"
    assert regex_scrub("call +1 (415) 555-0100.") == "call [phone]."
    assert regex_scrub("card 4111 1111 1111 1111 ok") == "card [card] ok"
    assert regex_scrub("3 + 4 = 7, on 2026-12-06") == "3 + 4 = 7, on 2026-12-06"


def test_scrubbed_text_never_stored(tmp_path):
    secret = "reach me at jane.doe@example.com or +1 415 555 0100"

    async def main():
        async with online(tmp_path) as (svc, http):
            pii = (await http.post("/v1/online/sessions", json={"consent": True})).json()
            clean = (await http.post("/v1/online/sessions", json={"consent": True})).json()
            await chat(svc, pii["api_key"], secret)
            await chat(svc, clean["api_key"], "tell me a story")
            decode = svc.service.gateway.renderer.decode
            return pii, clean, decode, svc.service.pool.counters
    pii, clean, decode, counters = asyncio.run(main())
    rows = stored(tmp_path)
    assert rows[pii["session_id"]].completions == [] and counters["scrub_dropped_calls"] == 1
    [c] = rows[clean["session_id"]].completions
    assert "tell me a story" in decode(c.prompt_ids)
    blob = b"".join(p.read_bytes() for p in tmp_path.glob("pool.sqlite*"))
    assert b"tell me a story".hex().encode() not in blob  # ids are int32 blobs, not text
    for needle in (b"jane.doe", b"example.com", b"555"):
        assert needle not in blob
    text = "".join(decode(c.prompt_ids + c.completion_ids) for t in rows.values()
                   for c in t.completions)
    assert "jane.doe" not in text and "415" not in text


def sft(trainer, renderer, text: str, steps: int = 12) -> None:
    """Hand-build a candidate: fine-tune the trainer to answer `text` to every prompt."""
    samples = []
    for q in ("hi", "go on", "say something", "hello"):
        prompt = renderer.render([Message("user", q)])
        target = renderer.encode(text)
        ids = prompt + target
        mask = [0] * len(prompt) + [1] * len(target)
        samples.append(TrainingSample(ids, mask, [0.0] * len(ids), [0.0] * len(ids),
                                      [0] * len(ids), temperatures=[1.0] * len(ids)))
    for _ in range(steps):
        trainer.supervised_step(samples)


def test_gate_promotes_better_rejects_worse(tmp_path):
    async def main():
        async with online(tmp_path, held_out_tolerance=0.0) as (svc, _):
            s = svc.service
            incumbent = {k: v.clone() for k, v in s.incumbent_state.items()}
            sft(s.trainer, s.gateway.renderer, "1234567890 ABCDEF")
            worse = await s.gate(s.trainer.step)
            back = all(torch.equal(v, incumbent[k]) for k, v in
                       s.trainer.model.state_dict().items() if k in incumbent)
            sft(s.trainer, s.gateway.renderer, "hello there my friend")
            better = await s.gate(s.trainer.step)
            return worse, back, better, s.engine.canary
    worse, back, better, canary = asyncio.run(main())
    assert worse["decision"] == "rejected" and back
    assert worse["held_out_candidate"] < worse["held_out_incumbent"]
    assert better["decision"] == "canary" and canary == better["version"]
    assert better["held_out_candidate"] > better["held_out_incumbent"] + 0.2
    lines = [json.loads(x) for x in (tmp_path / "online_decisions.jsonl").read_text()
             .splitlines()]
    assert [x["decision"] for x in lines] == ["rejected", "canary"]


def test_canary_split_ratio():
    engine = CanaryEngine(build_engine_stub(0), build_engine_stub(0), share=0.1, seed=3)
    assert [engine.assign(f"k{i}") for i in range(50)] == [None] * 50  # no canary running
    engine.canary = 9
    arms = [engine.assign(f"key{i}") for i in range(4000)]
    assert 340 <= arms.count(9) <= 460 and arms.count(None) == 4000 - arms.count(9)


def build_engine_stub(version: int):
    class Stub:
        max_model_len, weight_version = 256, version
    return Stub()


@pytest.mark.parametrize("canary_better", [False, True])
def test_canary_rollback_and_promotion(tmp_path, canary_better):
    async def main():
        async with online(tmp_path, canary_share=0.5, canary_min_feedback=3,
                          held_out_tolerance=1.0) as (svc, http):
            s = svc.service
            sft(s.trainer, s.gateway.renderer, "abc", steps=2)
            gate = await s.gate(s.trainer.step)
            sessions = [(await http.post("/v1/online/sessions", json={"consent": True})).json()
                        for _ in range(16)]
            seen = [(await chat(svc, x["api_key"], "hi", i))[1] for i, x in enumerate(sessions)]
            canary_key = sessions[seen.index(gate["version"])]["api_key"]
            client = AsyncOpenAI(base_url=svc.server.base_url, api_key=canary_key)
            stream = await client.chat.completions.create(  # streamed: the same arm
                model="policy", messages=[{"role": "user", "content": "more"}], max_tokens=4,
                stream=True)
            assert [c async for c in stream]
            await client.close()
            claude = AsyncAnthropic(base_url=svc.server.base_url.removesuffix("/v1"),
                                    api_key=canary_key, max_retries=0)
            raw = await claude.messages.with_raw_response.create(  # x-api-key: the same arm
                model="policy", max_tokens=4, messages=[{"role": "user", "content": "and?"}])
            assert int(raw.headers["x-forgerl-weight-version"]) == gate["version"]
            await claude.close()
            for x, version in zip(sessions, seen, strict=True):
                good = (version == gate["version"]) == canary_better
                await http.post("/v1/online/feedback",
                                json={"session_id": x["session_id"], "score": float(good)})
            new = (await http.post("/v1/online/sessions", json={"consent": True})).json()
            _, after = await chat(svc, new["api_key"], "hi")
            return gate, seen, s.decisions[-1], after, new, s.engine.incumbent.weight_version
    gate, seen, decision, after, new, incumbent = asyncio.run(main())
    v = gate["version"]
    assert gate["decision"] == "canary" and set(seen) == {0, v}
    rows = stored(tmp_path)
    assert sorted({c.weight_version for t in rows.values() for c in t.completions}) == [0, v]
    assert [sum(len(t.completions) for t in rows.values() if t.completions[0].weight_version
                == version) for version in (0, v)] == [seen.count(0) + (after == 0),
                                                        seen.count(v) + 2 + (after == v)]
    assert all(len({c.weight_version for c in t.completions}) == 1 for t in rows.values())
    if canary_better:
        assert decision["decision"] == "promote" and decision["canary_mean"] == 1.0
        assert after == incumbent == v
    else:
        assert decision["decision"] == "rollback" and decision["canary_mean"] == 0.0
        assert after == incumbent == 0  # the old weight version serves again
    assert rows[new["session_id"]].completions[0].weight_version == after

    async def restart():
        async with online(tmp_path) as (svc, http):
            x = (await http.post("/v1/online/sessions", json={"consent": True})).json()
            return svc.service.engine.incumbent.weight_version, (await chat(
                svc, x["api_key"], "hi"))[1], svc.service.trainer.step
    # a restart serves the last promoted weights, with their version
    assert asyncio.run(restart()) == ((v, v, v) if canary_better else (0, 0, 0))


def test_poisoned_feedback_is_rejected(tmp_path):
    """An incumbent that already serves the preference (a few fine-tuning steps toward
    lowercase replies); the first rounds' feedback is inverted: their candidate is caught."""
    spec = importlib.util.spec_from_file_location("online_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    model = build_tiny_model()
    sft(Trainer(model, lr=1e-2, device="cpu"), build_renderer(build_byte_tokenizer()),
        "hello there my friend", steps=3)
    config = OnlineConfig(batch_trajectories=12, steps_per_candidate=1, held_out_tolerance=0.0,
                          canary_share=0.25, canary_min_feedback=4)
    out = asyncio.run(bench.simulate(rounds=3, users=16, poison_round=0, run_dir=tmp_path,
                                     config=config, model=model))
    [first] = out["decisions"]
    assert first["decision"] == "rejected" and first["poisoned_share"] == 1.0
    assert first["held_out_candidate"] < first["held_out_incumbent"] - 0.2
    assert all(r["served_version"] == 0 for r in out["rounds"])
    assert out["counters"]["rejections"] == 1 and "promotions" not in out["counters"]


def test_stale_traffic_is_dropped(tmp_path):
    async def main():
        async with online(tmp_path, batch_trajectories=2, max_off_policy_steps=4) as (svc, http):
            s = svc.service
            ids = []
            for _ in range(3):
                x = (await http.post("/v1/online/sessions", json={"consent": True})).json()
                await chat(svc, x["api_key"], "hi")
                await http.post("/v1/online/feedback",
                                json={"session_id": x["session_id"], "score": 1.0})
                ids.append(x["session_id"])
            s.trainer.step = 5  # the traffic (version 0) is now 5 trainer steps old
            return await s.train_candidate(), dict(s.counters)
    version, counters = asyncio.run(main())
    assert version is None and counters["dropped_stale"] == 3
    pool = SQLitePool(tmp_path / "pool.sqlite")
    try:
        assert len(pool.task_indices("trained")) == 3 and pool.task_indices("finished") == []
    finally:
        pool.close()


def test_personal_data_split_between_prompt_and_completion_never_stored(tmp_path):
    """A prompt that begins an e-mail address and a completion that ends it ("jane.doe@exam" +
    "ple.com": neither half is an address on its own) is a changed call: not stored."""
    tok = build_byte_tokenizer()
    pool = SQLitePool(tmp_path / "pool.sqlite")
    private = PrivatePool(pool, tok.decode)
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731

    def call(prompt: str, completion: str) -> int:
        done = ids(completion)
        return private.add_completion(private.open(True, 0), Completion(
            ids(prompt), done, [0.0] * len(done), [0] * len(done), 0, "length"))
    assert call("write to jane.doe@exam", "ple.com today") == -1
    assert call("write to me", " tomorrow") == 0  # a clean call is stored
    pool.close()
    assert private.counters["scrub_dropped_calls"] == 1
    text = "".join(tok.decode(c.prompt_ids + c.completion_ids)
                   for t in stored(tmp_path).values() for c in t.completions)
    assert text == "write to me tomorrow"
