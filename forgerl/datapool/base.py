"""The data-pool contract: durable storage of tasks, trajectories, completions and rewards.

Writers: the gateway (completions), the controller (tasks, trajectory status, rewards, trained
marks). Reader: the scheduler/trainer (finished groups). Backends (`open_pool`): sqlite, postgres.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from forgerl.types import Completion, Group, Trajectory, TrajectoryStatus


def redacted(url: str) -> str:
    """`url` without its password, given after "user:" or as a `password=` parameter (for
    messages, logs and RUN_DIR/config.json)."""
    url = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)


class PoolLost(ConnectionError):
    """The pool's database server went away mid-run (PostgreSQL): the message is one line
    naming `datapool.url`; what was committed before stays, so the run resumes once it is back."""


class DataPool(Protocol):
    """Durable, process-safe store. Every write is committed before the call returns.

    The SQL backends (`SQLPool`, sql.py) also give the scheduler, the controller and resume
    (CASES.md C12): `finish_group`, `task_indices`, `finished_group_task_indices`,
    `missing_rollouts`, `reset_in_flight`, `commit_trained`, `untrain`, `discard`, `claim` and
    `stats`; a wrapper pool (`PrivatePool`) forwards them unchanged.
    """

    def add_task(self, task_index: int, payload: dict[str, Any]) -> None:
        """Append a task (status "queued"); idempotent for the same payload. Raises ValueError
        if `task_index` exists with a different payload."""
        ...

    def get_task(self, task_index: int) -> dict[str, Any]:
        """The payload given to add_task. Raises KeyError if unknown."""
        ...

    def create_trajectory(
        self, task_index: int, rollout_index: int, trajectory_id: str | None = None
    ) -> str:
        """Start a trajectory with status "running"; returns its id (a new uuid4 hex if None).
        The task need not exist. Raises ValueError if `trajectory_id` is already taken."""
        ...

    def add_completion(self, trajectory_id: str, completion: Completion) -> int:
        """Append one completion to a running trajectory; returns its turn index (0-based).

        Raises KeyError for an unknown trajectory and ValueError if it is no longer running.
        """
        ...

    def record_calls(
        self, calls: list[tuple[str, list[Completion], list[list[str]]]]
    ) -> list[list[int] | Exception]:
        """Record several model calls in one transaction (group commit): per call
        (trajectory_id, completions, per completion its event kinds); returns per call its turn
        indices or the KeyError / ValueError that kept it out (the others are recorded)."""
        ...

    def add_event(self, trajectory_id: str, kind: str, value: float = 1.0,
                  turn: int | None = None) -> int:
        """Record a process event on a turn of a running trajectory (None: the latest turn);
        returns that turn. Raises KeyError / ValueError like add_completion."""
        ...

    def finish_trajectory(
        self,
        trajectory_id: str,
        status: TrajectoryStatus,
        reward: float | None = None,
        error: str | None = None,
        turn_rewards: list[float] | None = None,
        policy_rewards: dict[str, float] | None = None,
    ) -> None:
        """Set the final status (finished | failed | aborted | aborted_infra), reward, error
        text, turn rewards and per-policy rewards (`Trajectory.policy_rewards`).

        Raises KeyError for an unknown trajectory, ValueError for a non-final `status` or a
        trajectory that already ended (a late report after a timeout abort is refused).
        """
        ...

    def get_trajectory(self, trajectory_id: str) -> Trajectory:
        """The trajectory with all its completions in turn order. Raises KeyError."""
        ...

    def get_group(self, task_index: int) -> Group:
        """All trajectories of one task, ordered by rollout_index."""
        ...

    def mark_trained(self, task_indices: list[int], step: int) -> None:
        """Record that these tasks' groups were consumed by optimizer step `step`, all or
        nothing. Raises KeyError for an unknown task, ValueError for one already trained."""
        ...

    def set_meta(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable value (e.g. the scheduler cursor) durably."""
        ...

    def get_meta(self, key: str, default: Any = None) -> Any:
        """Read a value stored with set_meta."""
        ...

    def close(self) -> None:
        """Close connections; idempotent. Later calls raise ValueError."""
        ...
