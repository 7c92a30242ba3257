"""The gateway on a PostgreSQL pool records what it records on SQLite, bit for bit: the same
seeded chat calls through the openai SDK and the real LocalEngine (tiny model) leave equal
completions in both pools (prompt and completion ids, float64 logprobs, weight versions), and
each equals what the engine sampled and what the client got."""

from __future__ import annotations

import asyncio

import pytest

from forgerl.datapool import open_pool

from .test_local_engine import Recording

local = pytest.importorskip("forgerl.engines.local", reason="forgerl.engines.local not importable")


def test_sqlite_and_postgres_pools_record_the_same_tokens(serve, tokenizer, tiny_model,
                                                          tmp_path, pg_url):
    recorded = []
    for where in (tmp_path / "p.sqlite", pg_url):
        engine = Recording(local.LocalEngine(tiny_model, max_model_len=512, max_batch_size=4))
        srv = serve(engine, tokenizer, pool=open_pool(where))
        try:
            tid, _, outs = srv.converse("Count.", 2, lambda _: {"role": "user", "content": "more"},
                                        max_tokens=8, logprobs=True)
            records = srv.pool.get_trajectory(tid).completions
            for out, record in zip(outs, records, strict=True):
                assert [t.logprob for t in out.choices[0].logprobs.content] == record.logprobs
            assert [(r.prompt_ids, r.completion_ids, r.logprobs) for r in records] == [
                (sent, gen.completion_ids, gen.logprobs) for sent, gen in engine.outputs]
            recorded.append(records)
        finally:
            asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)
    sqlite, postgres = recorded
    assert len(sqlite) == 2 and all(len(r.completion_ids) >= 1 for r in sqlite)
    strip = [(r.prompt_ids, r.completion_ids, r.logprobs, r.weight_versions, r.finish_reason,
              r.sampling, r.token_exact, r.extends_previous, r.trace) for r in sqlite]
    assert strip == [(r.prompt_ids, r.completion_ids, r.logprobs, r.weight_versions,
                      r.finish_reason, r.sampling, r.token_exact, r.extends_previous, r.trace)
                     for r in postgres]
