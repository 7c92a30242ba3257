"""An SDK retry must not split the trajectory (CASES.md C17).

The client timed out on request R1 ([u1]) while the gateway still answered it (C1), re-sent R1
(the SDK's `x-stainless-retry-count: 1`) and got C1', then continued with [u1, a1', tool r1] ->
C2. Trained: C1' -> C2 only; C1 is counted as a retry orphan, and rewards / advantages cover
C1' and C2. Sibling choices of one n > 1 call (same started_at) are not retries, a turn the
agent continued from is kept, and so are answers to the same prompt that no client marked as a
retry (an agent that samples several answers on purpose).
"""

from __future__ import annotations

import threading
import time

import pytest

from forgerl.gateway.renderer import ChatMLRenderer
from forgerl.trainer.advantages import trajectory_advantages
from forgerl.trainer.samples import drop_retry_orphans, trajectory_to_samples
from forgerl.trainer.trainer import Trainer
from forgerl.types import Completion, Group, SamplingParams, Trajectory

from .conftest import ScriptedEngine, reply

P1 = [1, 2, 3]
C1, C1B = [10, 11, 99], [12, 99]
INSERT = [98, 5, 6, 97]
P2 = P1 + C1B + INSERT  # extends C1', not C1
C2 = [20, 99]


def _turn(prompt, completion, started_at, retry=0):
    return Completion(prompt, completion, [-0.5] * len(completion), [0] * len(completion), 0,
                      "stop", sampling=SamplingParams(temperature=1.0), started_at=started_at,
                      retry=retry)


def _traj(tid, turns, reward, process=None):
    return Trajectory(tid, 0, 0, turns, reward=reward, turn_rewards=process, status="finished")


def test_the_retried_answer_is_dropped_with_its_process_reward():
    traj = _traj("s", [_turn(P1, C1, 1.0), _turn(P1, C1B, 2.0, retry=1), _turn(P2, C2, 3.0)],
                 1.0, process=[-0.3, 0.1, 0.2])
    kept, dropped = drop_retry_orphans(traj)
    assert dropped == 1
    assert [t.completion_ids for t in kept.completions] == [C1B, C2]
    assert kept.turn_rewards == [0.1, 0.2]
    assert len(traj.completions) == 3  # the recorded trajectory is left as it was
    # Group with a one-turn rollout of reward 0: outcome baseline 0.5, turn-0 process baseline
    # mean(0.3, 0) = 0.15, turn 1 alone (baseline 0.2): advantages by hand.
    other = _traj("o", [_turn(P1, [30, 99], 4.0)], 0.0)
    advs = trajectory_advantages([kept, other])
    assert advs == [[0.5 + 0.15, 0.5 + 0.0], [-0.5 - 0.15]]
    (sample,) = trajectory_to_samples(kept, advs[0])
    assert sample.input_ids == P2 + C2
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]


def test_two_leaves_keep_the_latest_and_the_first_turn_retry_alone_is_fine():
    kept, dropped = drop_retry_orphans(
        _traj("s", [_turn(P1, C1, 1.0), _turn(P1, C1B, 2.0, retry=1)], 1.0))
    assert dropped == 1
    assert [t.completion_ids for t in kept.completions] == [C1B]
    assert len(trajectory_to_samples(kept, [1.0])) == 1


def test_an_identical_retry_is_trained_once():
    """The retried request carried its seed, so C1' == C1 and C2 extends both: C1 is still the
    orphan, one sample C1' -> C2."""
    c2_prompt = P1 + C1 + INSERT
    traj = _traj("s", [_turn(P1, C1, 1.0), _turn(P1, C1, 2.0, retry=1),
                       _turn(c2_prompt, C2, 3.0)], 1.0)
    kept, dropped = drop_retry_orphans(traj)
    assert dropped == 1 and [t.started_at for t in kept.completions] == [2.0, 3.0]
    (sample,) = trajectory_to_samples(kept, [0.5, 0.5])
    assert sample.input_ids == c2_prompt + C2


def test_sibling_choices_and_continued_turns_are_not_orphans():
    siblings = _traj("n", [_turn(P1, C1, 1.0), _turn(P1, C1B, 1.0)], 1.0)  # one n=2 call
    assert drop_retry_orphans(siblings) == (siblings, 0)
    # The agent continued from the first answer and later re-asked the first prompt: both used.
    continued = _traj("c", [_turn(P1, C1B, 1.0), _turn(P2, C2, 2.0), _turn(P1, C1, 3.0, retry=1)],
                      1.0)
    assert drop_retry_orphans(continued) == (continued, 0)


def test_answers_the_agent_asked_for_twice_are_all_kept():
    """Four calls with one prompt, none a retry (sampled at once or one after another, some
    identical): all four are trained; a later retry of the same prompt drops only the leaves
    before it."""
    asked = [_turn(P1, C1, 1.0), _turn(P1, C1B, 1.01), _turn(P1, C1, 1.02), _turn(P1, C1B, 5.0)]
    traj = _traj("v", asked, 1.0)
    assert drop_retry_orphans(traj) == (traj, 0)
    assert len(trajectory_to_samples(traj, [0.5] * 4)) == 4
    kept, dropped = drop_retry_orphans(_traj("v", [*asked, _turn(P1, C1B, 9.0, retry=1)], 1.0))
    assert dropped == 4 and [t.started_at for t in kept.completions] == [9.0]


def test_a_resent_request_through_the_gateway_trains_one_trajectory(serve, tokenizer,
                                                                    tiny_model):
    """Over HTTP with the openai SDK: R1 sent twice (the gateway answered both), then turn 2.
    The trainer's batch holds C1' -> C2 as one sample and counts one retry orphan."""
    r = ChatMLRenderer(tokenizer)
    first, retried, second = reply(r, "4"), reply(r, "5"), reply(r, "done")
    srv = serve(ScriptedEngine([first, retried, second]), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    user = [{"role": "user", "content": "2+2?"}]
    client.chat.completions.create(model="tiny", messages=user)
    # the SDK's re-send, as it marks it (the first answer came after its timeout)
    answer = client.chat.completions.create(model="tiny", messages=user,
                                            extra_headers={"x-stainless-retry-count": "1"})
    client.chat.completions.create(model="tiny", messages=[
        *user, answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "sure?"}])
    srv.pool.finish_trajectory(tid, "finished", reward=1.0)
    traj = srv.pool.get_trajectory(tid)
    assert [c.completion_ids for c in traj.completions] == [first.ids, retried.ids, second.ids]
    assert [c.retry for c in traj.completions] == [0, 1, 0]
    other = _traj("o", [_turn(traj.completions[0].prompt_ids, first.ids, 9.0)], 0.0)
    batch = Trainer(tiny_model, device="cpu").prepare([Group(0, [traj, other])])
    assert batch.metrics["retry_orphans"] == 1.0
    assert batch.metrics["num_samples"] == 2.0
    c1b, c2 = traj.completions[1], traj.completions[2]
    assert c2.prompt_ids[: len(c1b.prompt_ids) + len(c1b.completion_ids)] == (
        c1b.prompt_ids + c1b.completion_ids)
    merged = next(s for s in batch.samples if s.trajectory_id == tid)
    assert merged.input_ids == c2.prompt_ids + c2.completion_ids


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_real_sdk_timeout_and_retry_records_only_the_retry(serve, tokenizer, sdk):
    """The SDK's own timeout (0.5 s) and retry against an engine that takes 3 s on the first
    send: the gateway cancels the abandoned call (nothing recorded, the engine's generate
    cancelled) and records the retry's answer with the attempt the SDK sent."""
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
    (turn,) = srv.pool.get_trajectory(tid).completions
    assert turn.completion_ids == fast.ids and turn.retry == 1


def test_answers_sampled_at_once_through_the_gateway_are_all_trained(serve, tokenizer,
                                                                     tiny_model):
    """An agent sends one prompt four times at once (self-consistency voting) with the openai
    SDK (no retry among them): four completions recorded, four samples, no retry orphan."""
    r = ChatMLRenderer(tokenizer)
    answers = [reply(r, t) for t in ("4", "4", "5", "4")]
    for a in answers:
        a.delay_s = 0.3
    srv = serve(ScriptedEngine(answers), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    user = [{"role": "user", "content": "2+2?"}]
    threads = [threading.Thread(target=client.chat.completions.create,
                                kwargs={"model": "tiny", "messages": user}) for _ in answers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    srv.pool.finish_trajectory(tid, "finished", reward=1.0)
    traj = srv.pool.get_trajectory(tid)
    assert sorted(c.completion_ids for c in traj.completions) == sorted(a.ids for a in answers)
    assert [c.retry for c in traj.completions] == [0] * 4
    other = _traj("o", [_turn(traj.completions[0].prompt_ids, answers[2].ids, 9.0)], 0.0)
    batch = Trainer(tiny_model, device="cpu").prepare([Group(0, [traj, other])])
    assert batch.metrics["retry_orphans"] == 0.0
    assert batch.metrics["num_samples"] == 5.0


def test_a_retry_count_that_is_no_small_count_is_recorded_as_0(serve, tokenizer):
    """Header values that are not 1-9 ASCII digits (negative, text, a fraction, the Latin-1
    superscript two, 10,000 digits) answer 200 and record retry 0; "2" records 2."""
    import httpx

    r = ChatMLRenderer(tokenizer)
    values = [b"-1", b"abc", b"1.5", b"\xb2", b"9" * 10_000, b"2"]
    srv = serve(ScriptedEngine([reply(r, "4") for _ in values]), tokenizer)
    tid, key = srv.session()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "?"}]}
    for v in values:
        answer = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=30,
                            headers={"authorization": f"Bearer {key}",
                                     "x-stainless-retry-count": v})
        assert answer.status_code == 200, answer.text
    assert [c.retry for c in srv.pool.get_trajectory(tid).completions] == [0] * 5 + [2]
