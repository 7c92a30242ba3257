"""Chat template variables (`chat_template_kwargs`, `[gateway] chat_template_kwargs`) on Qwen3's
real template (issue 47: reasoning turned off must reach the prompt, not be kept unapplied).

Through the real app and the official clients: a chat call with `enable_thinking: false` sends
the engine exactly `apply_chat_template(..., enable_thinking=False)` (the empty think block) and
records the applied variables with the turn; the same on the Anthropic and Responses routes;
the gateway's default applies when a request names none and a request wins per key; a second
turn with the same variables extends the first id for id, one with other variables renders anew
(counted); variables the gateway sets itself, and a non-object, are a 400 with nothing recorded.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from forgerl.gateway.renderers.templates import build_renderer
from tests.families import load
from tests.gateway.conftest import Scripted, ScriptedEngine

EMPTY_THINK = "<think>\n\n</think>\n\n"


def qwen3():
    fam = load("qwen3")
    return fam, build_renderer(fam.tokenizer, eos_ids=fam.eos_ids)


def template_ids(fam, messages, **kw) -> list[int]:
    return list(fam.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  return_dict=False, **kw))


def scripted(r, *texts):
    eot = [r.end_of_turn_id]
    return [Scripted(ids := r.encode(t) + eot, [-0.25] * len(ids)) for t in texts]


def test_enable_thinking_false_reaches_the_prompt_and_the_record(serve):
    fam, r = qwen3()
    srv = serve(ScriptedEngine(scripted(r, "Paris.", "Bye."), max_model_len=4096),
                fam.tokenizer, renderer=r)
    tid, key = srv.session()
    client = srv.client(key)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    turn1 = [{"role": "user", "content": "Capital of France?"}]
    client.chat.completions.create(model="tiny", messages=turn1, extra_body=off)
    turn2 = [*turn1, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "Thanks"}]
    client.chat.completions.create(model="tiny", messages=turn2, extra_body=off)
    c1, c2 = srv.pool.get_trajectory(tid).completions
    want1 = template_ids(fam, turn1, enable_thinking=False)
    assert c1.prompt_ids == want1
    assert fam.tokenizer.decode(want1).endswith("assistant\n" + EMPTY_THINK)
    assert want1 != template_ids(fam, turn1)  # the variable changes the tokens
    assert c1.request["template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in c1.request.get("kept", {})
    # turn 2 is planned with the same variables: it extends turn 1 or is the template's own
    # rendering of the whole conversation with them (Qwen3 rewrites replies in history)
    want2 = template_ids(fam, turn2, enable_thinking=False)
    if c2.extends_previous:
        assert c2.prompt_ids[: len(c1.prompt_ids) + len(c1.completion_ids)] == (
            c1.prompt_ids + c1.completion_ids)
    else:
        assert c2.prompt_ids == want2


def test_gateway_default_and_request_override(serve):
    fam, r = qwen3()
    srv = serve(ScriptedEngine(scripted(r, "A.", "B."), max_model_len=4096), fam.tokenizer,
                renderer=r, template_kwargs={"enable_thinking": False})
    tid, key = srv.session()
    client = srv.client(key)
    msgs = [{"role": "user", "content": "Hi"}]
    client.chat.completions.create(model="tiny", messages=msgs)
    client.chat.completions.create(model="tiny", messages=msgs,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    c1, c2 = srv.pool.get_trajectory(tid).completions
    assert c1.prompt_ids == template_ids(fam, msgs, enable_thinking=False)
    assert c2.prompt_ids == template_ids(fam, msgs, enable_thinking=True)
    assert c2.request["template_kwargs"] == {"enable_thinking": True}


def test_other_variables_never_extend_a_turn(serve):
    """A turn rendered with enable_thinking false is not the prefix of a prompt rendered with
    true: the second call renders the whole conversation with its own variables."""
    fam, r = qwen3()
    srv = serve(ScriptedEngine(scripted(r, "Paris.", "Bye."), max_model_len=4096),
                fam.tokenizer, renderer=r)
    tid, key = srv.session()
    client = srv.client(key)
    turn1 = [{"role": "user", "content": "Capital of France?"}]
    client.chat.completions.create(model="tiny", messages=turn1,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    turn2 = [*turn1, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "Thanks"}]
    client.chat.completions.create(model="tiny", messages=turn2)
    _, c2 = srv.pool.get_trajectory(tid).completions
    assert not c2.extends_previous
    assert c2.prompt_ids == template_ids(fam, turn2)


def test_anthropic_and_responses_routes_apply_them(serve):
    fam, r = qwen3()
    srv = serve(ScriptedEngine(scripted(r, "A.", "B."), max_model_len=4096), fam.tokenizer,
                renderer=r)
    tid, key = srv.session()
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msgs = [{"role": "user", "content": "Hi"}]
    anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key=key).messages.create(
        model="tiny", max_tokens=32, messages=msgs, extra_body=off)
    srv.client(key).responses.create(
        model="tiny", input="Hi", extra_body=off)
    for c in srv.pool.get_trajectory(tid).completions:
        assert c.prompt_ids == template_ids(fam, msgs, enable_thinking=False)
        assert c.request["template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("value, says", [({"tools": []}, "'tools' is set by the gateway"),
                                         ("enable_thinking", "must be an object")])
def test_bad_variables_are_a_400_naming_the_field(serve, value, says):
    fam, r = qwen3()
    srv = serve(ScriptedEngine(scripted(r, "A."), max_model_len=4096), fam.tokenizer, renderer=r)
    tid, key = srv.session()
    resp = httpx.post(srv.base_url + "/chat/completions",
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                            "chat_template_kwargs": value})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "chat_template_kwargs" and says in error["message"]
    assert srv.pool.get_trajectory(tid).completions == []


def test_chatml_renderer_takes_none(tokenizer):
    """SmolLM2's ChatML renderer has no template variables: bind gives itself back."""
    from forgerl.gateway.renderers.renderer import ChatMLRenderer
    r = ChatMLRenderer(tokenizer)
    assert r.bind({"enable_thinking": False}) is r
