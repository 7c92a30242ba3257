"""An SDK retry must not split the trajectory (CASES.md C17).

The client timed out on request R1 ([u1]) while the gateway still answered it (C1), re-sent R1
and got C1', then continued with [u1, a1', tool r1] -> C2. Trained: C1' -> C2 only; C1 is
counted as a retry orphan, and rewards / advantages cover C1' and C2. Sibling choices of one
n > 1 call (same started_at) are not retries, and a turn the agent continued from is kept.
"""

from __future__ import annotations

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


def _turn(prompt, completion, started_at):
    return Completion(prompt, completion, [-0.5] * len(completion), [0] * len(completion), 0,
                      "stop", sampling=SamplingParams(temperature=1.0), started_at=started_at)


def _traj(tid, turns, reward, process=None):
    return Trajectory(tid, 0, 0, turns, reward=reward, turn_rewards=process, status="finished")


def test_the_retried_answer_is_dropped_with_its_process_reward():
    traj = _traj("s", [_turn(P1, C1, 1.0), _turn(P1, C1B, 2.0), _turn(P2, C2, 3.0)], 1.0,
                 process=[-0.3, 0.1, 0.2])
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
    kept, dropped = drop_retry_orphans(_traj("s", [_turn(P1, C1, 1.0), _turn(P1, C1B, 2.0)], 1.0))
    assert dropped == 1
    assert [t.completion_ids for t in kept.completions] == [C1B]
    assert len(trajectory_to_samples(kept, [1.0])) == 1


def test_an_identical_retry_is_trained_once():
    """The retried request carried its seed, so C1' == C1 and C2 extends both: C1 is still the
    orphan, one sample C1' -> C2."""
    c2_prompt = P1 + C1 + INSERT
    traj = _traj("s", [_turn(P1, C1, 1.0), _turn(P1, C1, 2.0), _turn(c2_prompt, C2, 3.0)], 1.0)
    kept, dropped = drop_retry_orphans(traj)
    assert dropped == 1 and [t.started_at for t in kept.completions] == [2.0, 3.0]
    (sample,) = trajectory_to_samples(kept, [0.5, 0.5])
    assert sample.input_ids == c2_prompt + C2


def test_sibling_choices_and_continued_turns_are_not_orphans():
    siblings = _traj("n", [_turn(P1, C1, 1.0), _turn(P1, C1B, 1.0)], 1.0)  # one n=2 call
    assert drop_retry_orphans(siblings) == (siblings, 0)
    # The agent continued from the first answer and later re-asked the first prompt: both used.
    continued = _traj("c", [_turn(P1, C1B, 1.0), _turn(P2, C2, 2.0), _turn(P1, C1, 3.0)], 1.0)
    assert drop_retry_orphans(continued) == (continued, 0)


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
    answer = client.chat.completions.create(model="tiny", messages=user)  # the SDK's re-send
    client.chat.completions.create(model="tiny", messages=[
        *user, answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "sure?"}])
    srv.pool.finish_trajectory(tid, "finished", reward=1.0)
    traj = srv.pool.get_trajectory(tid)
    assert [c.completion_ids for c in traj.completions] == [first.ids, retried.ids, second.ids]
    other = _traj("o", [_turn(traj.completions[0].prompt_ids, first.ids, 9.0)], 0.0)
    batch = Trainer(tiny_model, device="cpu").prepare([Group(0, [traj, other])])
    assert batch.metrics["retry_orphans"] == 1.0
    assert batch.metrics["num_samples"] == 2.0
    c1b, c2 = traj.completions[1], traj.completions[2]
    assert c2.prompt_ids[: len(c1b.prompt_ids) + len(c1b.completion_ids)] == (
        c1b.prompt_ids + c1b.completion_ids)
    merged = next(s for s in batch.samples if s.trajectory_id == tid)
    assert merged.input_ids == c2.prompt_ids + c2.completion_ids
