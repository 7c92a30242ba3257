"""A chat call whose HTTP client went away is cancelled at once (issue 9, "smaller").

Replays the report: a non-streaming call whose client disconnected kept its engine slot until
max_tokens. Over real HTTP with a scripted engine that takes 60 s, an `openai` client that times
out after 0.5 s disconnects; the engine's generate() is cancelled within about a second (the
LocalEngine frees the slot of a cancelled call: tests/engines/test_local.py), nothing is
recorded, the earlier record stays, and the session's next call still reuses its ids.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import Scripted, ScriptedEngine, reply

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnected_client_cancels_the_engine_call(serve, tokenizer, stream):
    r = ChatMLRenderer(tokenizer)
    first, last = reply(r, "one"), reply(r, "three")
    slow = Scripted(**{**vars(reply(r, "never")), "delay_s": 60.0})
    srv = serve(ScriptedEngine([first, slow, last]), tokenizer)
    tid, key = srv.session()
    answer = srv.client(key).chat.completions.create(model="tiny", messages=USER)
    before = srv.pool.get_trajectory(tid).completions
    impatient = openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=0.5)
    messages = [*USER, answer.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "again"}]
    started = time.monotonic()
    # a stream's headers come at once (test_policy.py): its client times out reading the chunks
    with pytest.raises((openai.APITimeoutError, httpx.ReadTimeout)):
        list(impatient.chat.completions.create(model="tiny", messages=messages, stream=stream))
    while not srv.engine.cancelled and time.monotonic() - started < 30:
        time.sleep(0.01)
    (cancelled_at,) = srv.engine.cancelled
    assert cancelled_at - started < 0.5 + 1.0  # the client's timeout + about a second
    assert len(srv.engine.calls) == 2 and srv.gateway.counters["client_disconnects"] == 1
    assert srv.pool.get_trajectory(tid).completions == before and len(before) == 1
    assert len(srv.gateway.sessions.get(key).turns) == 1
    # the session goes on: the next call extends the recorded turn, id for id
    srv.client(key).chat.completions.create(model="tiny", messages=messages)
    a, b = srv.pool.get_trajectory(tid).completions
    assert a == before[0] and b.completion_ids == last.ids and b.extends_previous
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == (
        a.prompt_ids + a.completion_ids)
