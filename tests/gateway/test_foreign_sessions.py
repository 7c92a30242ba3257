"""Training groups hold only the controller's own rollouts (issue 9, "foreign data").

Replays both windows of the report over real HTTP: while a controller trains
(`Gateway(controller_tasks=True)`, what `forgerl train` builds), POST /v1/sessions with
`task_index >= 0` is a 403 and adds nothing to the group (the controller's `missing_rollouts`
is unchanged), and an HTTP reward for a controller rollout is a 403 whether its session is
open, closed (the window between `sessions.close` and scoring) or its trajectory ended, so the
controller's own write still lands. Out-of-range indices (`task_index = 2**63`, once a SQLite
OverflowError 500) are a 400; the 64-bit extremes are stored exactly.
"""

from __future__ import annotations

import httpx
import pytest

from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import ScriptedEngine, reply

USER = [{"role": "user", "content": "2 + 3?"}]
TASK = {"question": "2 + 3?", "answer": "5"}


def _error(r: httpx.Response, status: int, code: str, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    return err["message"]


def test_http_session_cannot_join_a_training_group(serve, tokenizer):
    renderer = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(renderer, "5")]), tokenizer, controller_tasks=True)
    srv.pool.add_task(3, TASK)
    tid, _ = srv.gateway.open_session(3, 0)  # the controller's own rollout 0 of task 3
    stats, group = srv.pool.stats(), srv.pool.get_group(3)
    for body in ({"task_index": 3, "rollout_index": 1, "temperature": 0.2}, {"task_index": 0}):
        r = httpx.post(f"{srv.base_url}/sessions", json=body, headers=srv.admin)
        message = _error(r, 403, "permission_denied", "task_index")
        assert message.startswith(f"task_index {body['task_index']}: task indices >= 0 are")
    assert srv.pool.stats() == stats and srv.pool.get_group(3) == group
    assert [t.id for t in group.trajectories] == [tid]
    assert srv.pool.missing_rollouts(3, 2) == [0, 1] and srv.gateway.external == set()
    # an ad-hoc session (negative index) works end to end and stays out of task 3's group
    r = httpx.post(f"{srv.base_url}/sessions", json={"temperature": 0.2}, headers=srv.admin)
    assert r.status_code == 200, r.text
    sid, key = r.json()["session_id"], r.json()["api_key"]
    srv.client(key).chat.completions.create(model="tiny", messages=USER)
    r = httpx.post(f"{srv.base_url}/sessions/{sid}/reward", json={"reward": 5.0}, headers=srv.admin)
    assert r.status_code == 200, r.text
    outside = srv.pool.get_trajectory(sid)
    assert (outside.task_index, outside.status, outside.reward) == (-1, "finished", 5.0)
    assert srv.pool.get_group(3) == group and srv.pool.missing_rollouts(3, 2) == [0, 1]


def test_without_a_controller_any_task_index_is_accepted(serve, tokenizer):
    srv = serve(ScriptedEngine([]), tokenizer)  # `forgerl gateway`: controller_tasks=False
    r = httpx.post(f"{srv.base_url}/sessions", json={"task_index": 3, "rollout_index": 1},
                   headers=srv.admin)
    assert r.status_code == 200, r.text
    traj = srv.pool.get_trajectory(r.json()["session_id"])
    assert (traj.task_index, traj.rollout_index, traj.status) == (3, 1, "running")


@pytest.mark.parametrize("state", ["open", "closed", "ended"])
def test_http_reward_for_a_controller_rollout_is_refused(serve, tokenizer, state):
    renderer = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(renderer, "5")]), tokenizer, controller_tasks=True)
    srv.pool.add_task(3, TASK)
    tid, key = srv.gateway.open_session(3, 0)
    srv.client(key).chat.completions.create(model="tiny", messages=USER)
    if state != "open":  # Services.rollout closes the session before it scores the rollout
        srv.gateway.sessions.close(key)
    if state == "ended":
        srv.pool.finish_trajectory(tid, "finished", reward=1.0)
    before, stats = srv.pool.get_trajectory(tid), srv.pool.stats()
    r = httpx.post(f"{srv.base_url}/sessions/{tid}/reward", json={"reward": 9.0}, headers=srv.admin)
    message = _error(r, 403, "permission_denied", "session_id")
    assert message == (f"session {tid!r} was not opened by POST /v1/sessions; the controller "
                       "scores its rollout")
    assert srv.pool.get_trajectory(tid) == before and srv.pool.stats() == stats
    assert len(before.completions) == 1
    assert (before.status, before.reward) == (("finished", 1.0) if state == "ended"
                                               else ("running", None))
    if state != "ended":  # the controller's own write lands
        srv.pool.finish_trajectory(tid, "finished", reward=0.5)
        after = srv.pool.get_trajectory(tid)
        assert (after.status, after.reward, after.completions) == (
            "finished", 0.5, before.completions)
    r = httpx.post(f"{srv.base_url}/sessions/not-a-session/reward", json={"reward": 9.0},
                   headers=srv.admin)
    _error(r, 404, "session_not_found", "session_id")


OUT_OF_RANGE = [
    ({"task_index": 2**63}, "task_index"),
    ({"task_index": -(2**63) - 1}, "task_index"),
    ({"rollout_index": 2**63}, "rollout_index"),
    ({"rollout_index": -1}, "rollout_index"),
    ({"task_index": 10**30}, "task_index"),
]


@pytest.mark.parametrize(("body", "param"), OUT_OF_RANGE, ids=lambda v: str(v)[:24])
def test_out_of_range_indices_are_400(serve, tokenizer, body, param):
    srv = serve(ScriptedEngine([]), tokenizer)
    stats = srv.pool.stats()
    r = httpx.post(f"{srv.base_url}/sessions", json=body, headers=srv.admin)
    message = _error(r, 400, "invalid_value", param)
    assert message.startswith(f"{param}: Input should be")
    assert srv.pool.stats() == stats and srv.gateway.external == set()


@pytest.mark.parametrize("task_index", [-(2**63), 2**63 - 1])
def test_64_bit_extremes_are_stored_exactly(serve, tokenizer, task_index):
    srv = serve(ScriptedEngine([]), tokenizer)
    r = httpx.post(f"{srv.base_url}/sessions",
                   json={"task_index": task_index, "rollout_index": 2**63 - 1}, headers=srv.admin)
    assert r.status_code == 200, r.text
    traj = srv.pool.get_trajectory(r.json()["session_id"])
    assert (traj.task_index, traj.rollout_index) == (task_index, 2**63 - 1)
