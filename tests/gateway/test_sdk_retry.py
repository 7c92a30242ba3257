"""An SDK retry must not split the trajectory (CASES.md C17).

The client timed out on request R1 ([u1]) while the gateway was recording its answer C1, re-sent
R1 and got C1', then continued with [u1, a1', tool r1] -> C2. The gateway marks C1 undelivered
(`UNDELIVERED` event: its client left during the commit); trained: C1' -> C2 only, C1 counted as
a retry orphan, rewards / advantages cover C1' and C2. A client that leaves before the answer is
ready cancels the call: nothing recorded. Answers the agent received are all trained, however
often it sent the same prompt (samples to vote on, sibling choices of one n > 1 call).
"""

from __future__ import annotations

import threading
import time

import pytest

from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.trainer.advantages import trajectory_advantages
from forgerl.trainer.samples import drop_retry_orphans, trajectory_to_samples
from forgerl.trainer.trainer import Trainer
from forgerl.types import UNDELIVERED, Event, Group
from tests.factories import completion, trajectory

from .conftest import ScriptedEngine, reply

P1 = [1, 2, 3]
C1, C1B = [10, 11, 99], [12, 99]
INSERT = [98, 5, 6, 97]
P2 = P1 + C1B + INSERT  # extends C1', not C1
C2 = [20, 99]


def test_the_undelivered_answer_is_dropped_with_its_process_reward_and_events():
    turns = [completion(P1, C1, started_at=1.0), completion(P1, C1B, started_at=2.0),
             completion(P2, C2, started_at=3.0)]
    traj = trajectory("s", turns, 1.0, process=[-0.3, 0.1, 0.2],
                      events=[Event(0, UNDELIVERED), Event(0, "invalid_tool_call"), Event(2, "x")])
    kept, dropped = drop_retry_orphans(traj)
    assert dropped == 1
    assert [t.completion_ids for t in kept.completions] == [C1B, C2]
    assert kept.turn_rewards == [0.1, 0.2] and kept.events == [Event(1, "x")]
    assert len(traj.completions) == 3  # the recorded trajectory is left as it was
    # Group with a one-turn rollout of reward 0: outcome baseline 0.5, turn-0 process
    # reward-to-go 0.1 + 0.2 against 0, baseline 0.15; turn 1 alone (baseline 0.2): by hand.
    other = trajectory("o", [completion(P1, [30, 99], started_at=4.0)], 0.0)
    advs = trajectory_advantages([kept, other])
    assert advs == [[0.5 + 0.15, 0.5 + 0.0], [-0.5 - 0.15]]
    (sample,) = trajectory_to_samples(kept, advs[0])
    assert sample.input_ids == P2 + C2
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]


def test_an_identical_retry_is_trained_once_and_a_first_turn_retry_alone_is_fine():
    """The retried request carried its seed, so C1' == C1 and C2 extends both: C1 is still the
    orphan, one sample C1' -> C2. A session ending right after C1' trains C1' alone."""
    c2_prompt = P1 + C1 + INSERT
    turns = [completion(P1, C1, started_at=1.0), completion(P1, C1, started_at=2.0),
             completion(c2_prompt, C2, started_at=3.0)]
    traj = trajectory("s", turns, 1.0, events=[Event(0, UNDELIVERED)])
    kept, dropped = drop_retry_orphans(traj)
    assert dropped == 1 and [t.started_at for t in kept.completions] == [2.0, 3.0]
    (sample,) = trajectory_to_samples(kept, [0.5, 0.5])
    assert sample.input_ids == c2_prompt + C2
    turns = [completion(P1, C1, started_at=1.0), completion(P1, C1B, started_at=2.0)]
    kept, dropped = drop_retry_orphans(trajectory("s", turns, 1.0, events=[Event(0, UNDELIVERED)]))
    assert dropped == 1 and [t.completion_ids for t in kept.completions] == [C1B]
    assert len(trajectory_to_samples(kept, [1.0])) == 1


def test_answers_the_agent_received_are_all_kept():
    """Siblings of one n = 2 call, four calls with one prompt (some identical, at once or one
    after another), a turn continued from and the same prompt asked again later: no orphan."""
    siblings = trajectory(
        "n", [completion(P1, C1, started_at=1.0), completion(P1, C1B, started_at=1.0)], 1.0)
    assert drop_retry_orphans(siblings) == (siblings, 0)
    asked = trajectory("v", [completion(P1, C1, started_at=1.0),
                             completion(P1, C1B, started_at=1.01),
                             completion(P1, C1, started_at=1.02),
                             completion(P1, C1B, started_at=5.0)], 1.0)
    assert drop_retry_orphans(asked) == (asked, 0)
    assert len(trajectory_to_samples(asked, [0.5] * 4)) == 4
    continued = trajectory("c", [completion(P1, C1B, started_at=1.0),
                                 completion(P2, C2, started_at=2.0),
                                 completion(P1, C1, started_at=3.0)], 1.0)
    assert drop_retry_orphans(continued) == (continued, 0)


def test_a_timeout_during_the_commit_marks_the_turn_and_the_trainer_drops_it(serve, tokenizer,
                                                                             tiny_model):
    """Over HTTP with the openai SDK (timeout 0.5 s, one retry): the first answer's commit
    takes 0.8 s, so the SDK gives up during it and re-sends; the agent continues from the
    retry's answer. The pool holds all three turns, the first marked undelivered; the
    trainer's batch holds C1' -> C2 as one sample and counts one retry orphan."""
    from openai import OpenAI

    r = ChatMLRenderer(tokenizer)
    first, retried, second = reply(r, "4"), reply(r, "5"), reply(r, "done")
    srv = serve(ScriptedEngine([first, retried, second]), tokenizer)
    record_calls, slow = srv.pool.record_calls, [0.8]

    def slow_first(calls):
        time.sleep(slow.pop() if slow else 0.0)
        return record_calls(calls)

    srv.pool.record_calls = slow_first
    tid, key = srv.session()
    client = OpenAI(base_url=srv.base_url, api_key=key, max_retries=1, timeout=0.5)
    user = [{"role": "user", "content": "2+2?"}]
    answer = client.chat.completions.create(model="tiny", messages=user)
    assert answer.choices[0].message.content == "5"
    client.chat.completions.create(model="tiny", messages=[
        *user, answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "sure?"}])
    assert srv.gateway.counters["client_disconnects"] == 1
    srv.pool.finish_trajectory(tid, "finished", reward=1.0)
    traj = srv.pool.get_trajectory(tid)
    assert [c.completion_ids for c in traj.completions] == [first.ids, retried.ids, second.ids]
    assert traj.events == [Event(0, UNDELIVERED)]
    turn = completion(traj.completions[0].prompt_ids, first.ids, started_at=9.0)
    other = trajectory("o", [turn], 0.0)
    batch = Trainer(tiny_model, device="cpu").prepare([Group(0, [traj, other])])
    assert batch.metrics["retry_orphans"] == 1.0
    assert batch.metrics["num_samples"] == 2.0
    c1b, c2 = traj.completions[1], traj.completions[2]
    assert c2.prompt_ids[: len(c1b.prompt_ids) + len(c1b.completion_ids)] == (
        c1b.prompt_ids + c1b.completion_ids)
    merged = next(s for s in batch.samples if s.trajectory_id == tid)
    assert merged.input_ids == c2.prompt_ids + c2.completion_ids


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_timeout_before_the_answer_records_only_the_retry(serve, tokenizer, sdk):
    """The SDK's own timeout (0.5 s) and retry against an engine that takes 3 s on the first
    send: the gateway cancels the abandoned call (nothing recorded, the engine's generate
    cancelled) and records the retry's answer alone, unmarked."""
    import anthropic
    from openai import OpenAI

    r = ChatMLRenderer(tokenizer)
    slow, fast = reply(r, "4"), reply(r, "5")
    slow.delay_s = 3.0
    engine = ScriptedEngine([slow, fast])
    srv = serve(engine, tokenizer)
    tid, key = srv.session()
    user = [{"role": "user", "content": "2+2?"}]
    if sdk == "openai":
        client = OpenAI(base_url=srv.base_url, api_key=key, max_retries=1, timeout=0.5)
        text = client.chat.completions.create(model="tiny", messages=user).choices[0].message
        text = text.content
    else:
        client = anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key=key,
                                     max_retries=1, timeout=0.5)
        text = client.messages.create(model="tiny", max_tokens=16, messages=user).content[0].text
    assert text == "5"
    deadline = time.monotonic() + 5
    while not engine.cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(engine.cancelled) == 1 and srv.gateway.counters["client_disconnects"] == 1
    traj = srv.pool.get_trajectory(tid)
    assert [t.completion_ids for t in traj.completions] == [fast.ids] and traj.events == []


def test_answers_sampled_at_once_through_the_gateway_are_all_trained(serve, tokenizer,
                                                                     tiny_model):
    """An agent sends one prompt four times at once (self-consistency voting) with the openai
    SDK, then once more: five completions recorded, none marked, five samples trained."""
    r = ChatMLRenderer(tokenizer)
    answers = [reply(r, t) for t in ("4", "4", "5", "4", "4")]
    for a in answers:
        a.delay_s = 0.3
    srv = serve(ScriptedEngine(answers), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}]}
    threads = [threading.Thread(target=client.chat.completions.create, kwargs=kw)
               for _ in answers[:4]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.chat.completions.create(**kw)
    srv.pool.finish_trajectory(tid, "finished", reward=1.0)
    traj = srv.pool.get_trajectory(tid)
    assert sorted(c.completion_ids for c in traj.completions) == sorted(a.ids for a in answers)
    assert traj.events == []
    turn = completion(traj.completions[0].prompt_ids, answers[2].ids, started_at=9.0)
    other = trajectory("o", [turn], 0.0)
    batch = Trainer(tiny_model, device="cpu").prepare([Group(0, [traj, other])])
    assert batch.metrics["retry_orphans"] == 0.0
    assert batch.metrics["num_samples"] == 6.0
