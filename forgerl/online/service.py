"""The online service: sessions with consent, late feedback, the background trainer and the
promotion gate.

    open (consent) ─► calls on the gateway ─► feedback (late) ─► reward in the pool
    step: ready trajectories ─► drop stale ─► Trainer.train_step (CISPO) ─► candidate version
          ─► held-out gate (candidate >= incumbent - tolerance) ─► canary (share of sessions)
          ─► enough feedback in both arms ─► promote (incumbent engine loads it) | roll back

Versions are trainer steps: the incumbent serves version v, a candidate is the trainer's step
after its optimizer steps. Traffic older than `max_off_policy_steps` trainer steps, or sampled
by a candidate that was rejected or rolled back, is dropped (marked consumed, never trained);
the rest is importance-corrected by CISPO against its recorded behaviour logprobs. After a
rejection or rollback the trainer restarts from the incumbent's weights (optimizer state
cleared). A promotion writes the weights to RUN_DIR/online_served.pt, which a restart serves.
Every decision is one JSON line in RUN_DIR/online_decisions.jsonl (and in `decisions`) with
the numbers behind it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forgerl.config import OnlineConfig
from forgerl.gateway.conversation import Message
from forgerl.gateway.core import Gateway
from forgerl.gateway.errors import GatewayError
from forgerl.gateway.renderers.renderer import Renderer
from forgerl.online.canary import CanaryEngine
from forgerl.online.privacy import PrivatePool
from forgerl.trainer.trainer import Trainer
from forgerl.types import NO_CALL, Group, SamplingParams, Trajectory

log = logging.getLogger(__name__)
SERVED = "online_served.pt"
"""The last promoted weights in RUN_DIR ({"version", "state"}); a restart serves them."""
Verifier = Callable[[dict, str], float]
"""(task, reply text) → score; the higher the better."""


@dataclass
class HeldOut:
    """The gate's held-out evaluation: `samples` replies per task (dicts with "question"),
    sampled with fixed seeds so two policies answer the same draws, scored by `verifier`."""

    tasks: list[dict]
    verifier: Verifier
    max_tokens: int = 64
    samples: int = 2
    temperature: float = 1.0
    seed: int = 0

    async def score(self, engine: Any, renderer: Renderer) -> float:
        """The mean verifier score of `engine`'s replies (a `RolloutEngine`)."""
        jobs, tasks = [], []
        for i, task in enumerate(self.tasks):
            ids = renderer.render([Message("user", task["question"])])
            for j in range(self.samples):
                params = SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens,
                                        stop_token_ids=list(renderer.stop_ids),
                                        seed=self.seed + i * self.samples + j)
                jobs.append(engine.generate(ids, params))
                tasks.append(task)
        outs = await asyncio.gather(*jobs)
        scores = [self.verifier(task, renderer.decode(
            [t for t in out.completion_ids if t not in renderer.stop_ids]))
            for task, out in zip(tasks, outs, strict=True)]
        return sum(scores) / len(scores)


@dataclass
class OnlineSession:
    """api_key; arm: the candidate version it was assigned (None: incumbent); canary: the
    canary running when it opened (None: none)."""

    api_key: str
    arm: int | None
    canary: int | None


class OnlineService:
    """Sessions, feedback, training and the gate over one gateway (module docstring).

    The gateway must record into `pool` and call `engine`. `trainer` holds the incumbent's
    weights when this starts. counters: sessions, sessions_consented, feedback,
    feedback_unconsented, dropped_stale, trained_trajectories, candidates, promotions,
    rejections, rollbacks.
    """

    def __init__(self, gateway: Gateway, pool: PrivatePool, engine: CanaryEngine,
                 trainer: Trainer, held_out: HeldOut, config: OnlineConfig,
                 run_dir: str | Path) -> None:
        self.gateway, self.pool, self.engine, self.trainer = gateway, pool, engine, trainer
        self.held_out, self.config = held_out, config
        self.log_path = Path(run_dir) / "online_decisions.jsonl"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.sessions: dict[str, OnlineSession] = {}
        self.window: dict[str, list[float]] = {"incumbent": [], "candidate": []}
        self.incumbent_state = self._snapshot()
        self.candidate_state: dict | None = None
        self.rejected: set[int] = set()
        self.decisions: list[dict[str, Any]] = []
        self.counters: Counter[str] = Counter()
        self.reward_by_version: dict[int, list[float]] = {}
        self.batches: dict[int, list[Trajectory]] = {}
        """Candidate version → the trajectories it was trained on."""
        self.next_task = max(pool.task_indices(), default=-1) + 1

    def _snapshot(self) -> dict:
        return {k: v.detach().clone() for k, v in self.trainer.state_dict_for_sync().items()}

    # ---- sessions and feedback ---------------------------------------------------------------

    def open_session(self, consent: bool) -> dict[str, Any]:
        """A new session: {session_id, api_key, consent}. Its trajectory is in the pool only
        when `consent` (PrivatePool.open)."""
        trajectory_id = self.pool.open(consent, self.next_task)
        self.next_task += consent
        api_key = self.gateway.sessions.create(trajectory_id)
        self.sessions[trajectory_id] = OnlineSession(api_key, self.engine.assign(api_key),
                                                     self.engine.canary)
        self.counters["sessions"] += 1
        self.counters["sessions_consented"] += consent
        return {"session_id": trajectory_id, "api_key": api_key, "consent": consent}

    async def feedback(self, session_id: str, reward: float) -> dict[str, Any]:
        """The session's reward, any time after its calls: stored as its trajectory's reward
        (consented) or counted in memory only (unconsented). Its session key stops working.

        Raises GatewayError 404 `session_not_found` for an unknown id, 409 `feedback_exists`
        for a second feedback (the first stays).
        """
        stored = session_id not in self.pool.unconsented
        if not stored:
            if (first := self.pool.unconsented[session_id]) is not None:
                raise GatewayError(409, f"session {session_id!r} already has feedback {first}",
                                   "feedback_exists", "session_id")
            self.pool.unconsented[session_id] = reward
            self.counters["feedback_unconsented"] += 1
        else:
            try:
                trajectory = self.pool.get_trajectory(session_id)
            except KeyError:
                raise GatewayError(404, f"unknown session {session_id!r}", "session_not_found",
                                   "session_id") from None
            if trajectory.status != "running":
                raise GatewayError(409, f"session {session_id!r} already has feedback "
                                   f"{trajectory.reward} ({trajectory.status})",
                                   "feedback_exists", "session_id")
            if trajectory.completions:
                self.pool.finish_trajectory(session_id, "finished", reward)
            else:  # nothing stored to train on (its calls were dropped by the scrub)
                self.pool.finish_trajectory(session_id, "failed", error=NO_CALL)
            self.pool.finish_group(trajectory.task_index)
        self.counters["feedback"] += 1
        if (session := self.sessions.pop(session_id, None)) is not None:
            self.gateway.sessions.close(session.api_key)
            self.engine.arms.pop(session.api_key, None)
            self._count(session, reward)
        await self.decide()
        return {"session_id": session_id, "reward": reward, "stored": stored}

    def _count(self, session: OnlineSession, reward: float) -> None:
        version = (session.arm if session.arm is not None
                   else self.engine.incumbent.weight_version)
        self.reward_by_version.setdefault(version, []).append(reward)
        if self.engine.canary is not None and session.canary == self.engine.canary:
            self.window["candidate" if session.arm is not None else "incumbent"].append(reward)

    # ---- the background trainer and the gate -------------------------------------------------

    async def step(self) -> dict[str, Any] | None:
        """One pass: decide a running canary, else train a candidate from the ready traffic
        and gate it. Returns the decision made (None: none)."""
        if self.engine.canary is not None:
            return await self.decide()
        version = await self.train_candidate()
        return None if version is None else await self.gate(version)

    def ready(self) -> tuple[list[tuple[int, Trajectory]], list[int]]:
        """(fresh, stale): rewarded trajectories not yet trained, by task index; stale ones
        (module docstring) are only to be marked consumed."""
        fresh, stale = [], []
        for index in self.pool.finished_group_task_indices():
            done = [t for t in self.pool.get_group(index).trajectories if t.status == "finished"]
            versions = {v for t in done for c in t.completions for v in c.weight_versions}
            if (not versions or versions & self.rejected
                    or self.trainer.step - min(versions) > self.config.max_off_policy_steps):
                stale.append(index)
            else:
                fresh.append((index, done[0]))
        return fresh, stale

    async def train_candidate(self) -> int | None:
        """Up to `steps_per_candidate` optimizer steps of `batch_trajectories` each on the
        ready traffic (one batch-mean baseline per step); the candidate version, None when
        fewer than one batch is ready."""
        fresh, stale = self.ready()
        if stale:
            self.pool.mark_trained(stale, self.trainer.step)
            self.counters["dropped_stale"] += len(stale)
        b = self.config.batch_trajectories
        steps = min(self.config.steps_per_candidate, len(fresh) // b)
        if not steps:
            return None
        fresh.reverse()  # the newest traffic first: the smallest off-policy lag
        trained: list[Trajectory] = []
        for k in range(steps):
            chunk = fresh[k * b:(k + 1) * b]
            group = Group(chunk[0][0], [t for _, t in chunk])
            await asyncio.to_thread(self.trainer.train_step, [group])
            self.pool.mark_trained([i for i, _ in chunk], self.trainer.step)
            trained += group.trajectories
        self.counters["trained_trajectories"] += len(trained)
        self.counters["candidates"] += 1
        self.batches[self.trainer.step] = trained
        return self.trainer.step

    async def gate(self, version: int) -> dict[str, Any]:
        """The held-out gate of the trainer's weights as `version`: a canary when they score
        at least the incumbent's minus `held_out_tolerance`, else rejected."""
        state = self._snapshot()
        await self.engine.candidate.update_weights(state, version)
        renderer = self.gateway.renderer
        incumbent = await self.held_out.score(self.engine.incumbent, renderer)
        candidate = await self.held_out.score(self.engine.candidate, renderer)
        batch = self.batches.get(version, [])
        versions = [v for t in batch for c in t.completions for v in c.weight_versions]
        numbers = {"held_out_incumbent": incumbent, "held_out_candidate": candidate,
                   "tolerance": self.config.held_out_tolerance, "trained": len(batch),
                   "trained_reward_mean": sum(t.reward or 0.0 for t in batch) / max(len(batch), 1),
                   "version_lag_mean": sum(version - v for v in versions)
                   / max(len(versions), 1)}
        if candidate < incumbent - self.config.held_out_tolerance:
            self.counters["rejections"] += 1
            self.rejected.add(version)
            self._reset()
            return self._record("rejected", version, numbers)
        self.candidate_state, self.engine.canary = state, version
        self.window = {"incumbent": [], "candidate": []}
        return self._record("canary", version, numbers | {"share": self.engine.share})

    async def decide(self) -> dict[str, Any] | None:
        """Decide a running canary once each arm has `canary_min_feedback` feedback from
        sessions opened during it: roll back when the canary's mean < the incumbent's minus
        `canary_tolerance`, else promote. None while undecided."""
        version, arms = self.engine.canary, self.window
        if version is None or min(map(len, arms.values())) < self.config.canary_min_feedback:
            return None
        means = {k: sum(v) / len(v) for k, v in arms.items()}
        numbers = {"canary_mean": means["candidate"], "incumbent_mean": means["incumbent"],
                   "canary_n": len(arms["candidate"]), "incumbent_n": len(arms["incumbent"]),
                   "tolerance": self.config.canary_tolerance}
        self.engine.canary = None
        if means["candidate"] < means["incumbent"] - self.config.canary_tolerance:
            self.counters["rollbacks"] += 1
            self.rejected.add(version)
            self._reset()
            return self._record("rollback", version, numbers)
        assert self.candidate_state is not None
        entry = self._record("promote", version, numbers)
        await self.engine.incumbent.update_weights(self.candidate_state, version)
        self.incumbent_state, self.candidate_state = self.candidate_state, None
        self.counters["promotions"] += 1
        self.save_served(version)
        return entry

    def save_served(self, version: int) -> None:
        """Write the served weights to RUN_DIR/online_served.pt (atomically: a temporary file,
        then a rename), then their version to the pool's meta `online_served_version`."""
        path = self.log_path.parent / SERVED
        tmp = path.with_suffix(".tmp")
        torch.save({"version": version, "state": self.incumbent_state}, tmp)
        os.replace(tmp, path)
        self.pool.set_meta("online_served_version", version)

    def _reset(self) -> None:
        """The trainer back on the incumbent's weights, its optimizer state cleared."""
        self.trainer.model.load_state_dict(self.incumbent_state, strict=False)
        self.trainer.optimizer.state.clear()
        self.candidate_state = None

    def _record(self, kind: str, version: int, numbers: dict[str, Any]) -> dict[str, Any]:
        entry = {"time": time.time(), "decision": kind, "version": version,
                 "incumbent_version": self.engine.incumbent.weight_version, **numbers}
        self.decisions.append(entry)
        with self.log_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        log.info("online: %s", entry)
        return entry

    async def run(self) -> None:
        """`step` every `train_every_s` seconds until cancelled (a failure is logged)."""
        while True:
            await asyncio.sleep(self.config.train_every_s)
            try:
                await self.step()
            except Exception:
                log.exception("online trainer pass failed")

    def status(self) -> dict[str, Any]:
        """The served and canary versions, counters and the last decision."""
        return {"incumbent_version": self.engine.incumbent.weight_version,
                "canary_version": self.engine.canary, "counters": dict(self.counters),
                "pool": dict(self.pool.counters),
                "last_decision": self.decisions[-1] if self.decisions else None}
