"""The generation queue: tasks T0, T1, … each run as a group of G rollouts (Forge §3.1).

Pure bookkeeping, no I/O and no clock. A queue index is a position in the stream of tasks (the
controller maps it to a data-set item, e.g. `index % len(tasks)`, so epoch e re-admits the same
items under new indices); each index is admitted, finished and trained at most once. Per index
the queue tracks:

- admitted: dispatched to agents, with the engine weight_version at dispatch;
- finished: the group is complete (all G rollouts ended, or finalised by a timeout), with the
  oldest weight_version among its tokens, in finish order;
- trained: consumed by an optimizer step.

The head `i` is the lowest index not yet trained. `pending` holds indices that must be dispatched
(again) before any new one: the in-flight tasks of a run that was killed (CASES.md C12).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationQueue:
    """State of the task stream; see the module docstring.

    Attributes:
        group_size: G, rollouts per task (used by `rollout_ended`).
        num_tasks: total indices that may ever be admitted (None: unbounded).
        next_index: the lowest index never admitted.
        admitted: untrained admitted index → weight_version at dispatch.
        finished: finished, untrained index → oldest token weight_version (dict order = finish
            order).
        head: the lowest untrained index.
        trained_above_head: trained indices > head (the window may train past the head).
        pending: indices to dispatch (again) before `next_index`, ascending.
        ended: index → rollouts ended so far, for groups still running.
    """

    group_size: int = 1
    num_tasks: int | None = None
    next_index: int = 0
    admitted: dict[int, int] = field(default_factory=dict)
    finished: dict[int, int] = field(default_factory=dict)
    head: int = 0
    trained_above_head: set[int] = field(default_factory=set)
    pending: list[int] = field(default_factory=list)
    ended: dict[int, tuple[int, int]] = field(default_factory=dict)

    # ---- queries ------------------------------------------------------------------------------

    def is_trained(self, task_index: int) -> bool:
        """True if `task_index` was consumed by an optimizer step."""
        return task_index < self.head or task_index in self.trained_above_head

    def in_flight(self) -> list[int]:
        """Admitted indices whose group is not finished yet (still generating), ascending."""
        return sorted(i for i in self.admitted if i not in self.finished)

    def next_to_dispatch(self) -> int | None:
        """The index `dispatch` would start next, or None when the stream is exhausted."""
        if self.pending:
            return self.pending[0]
        if self.num_tasks is not None and self.next_index >= self.num_tasks:
            return None
        return self.next_index

    # ---- transitions --------------------------------------------------------------------------

    def dispatch(self, version: int) -> int:
        """Admit `next_to_dispatch()` at engine weight_version `version`; returns its index.

        Raises IndexError when the stream is exhausted.
        """
        task_index = self.next_to_dispatch()
        if task_index is None:
            raise IndexError(f"all {self.num_tasks} tasks were admitted")
        if self.pending:
            self.pending.pop(0)
        else:
            self.next_index += 1
        self.admitted[task_index] = version
        return task_index

    def rollout_ended(self, task_index: int, oldest_version: int) -> bool:
        """Count one ended rollout; finishes the group (returns True) at the G-th one."""
        count, oldest = self.ended.get(task_index, (0, oldest_version))
        count, oldest = count + 1, min(oldest, oldest_version)
        if count < self.group_size:
            self.ended[task_index] = (count, oldest)
            return False
        self.ended.pop(task_index, None)
        return self.finish(task_index, oldest)

    def finish(self, task_index: int, oldest_version: int) -> bool:
        """Mark the group finished; returns False (no-op) if it already was, or was trained.

        Raises KeyError if `task_index` was never admitted.
        """
        if self.is_trained(task_index) or task_index in self.finished:
            return False
        if task_index not in self.admitted:
            raise KeyError(f"task {task_index} finished but was never admitted")
        self.finished[task_index] = oldest_version
        self.ended.pop(task_index, None)
        return True

    def train(self, task_indices: list[int]) -> dict[int, int]:
        """Mark finished groups trained; returns index → oldest token version. Slides the head.

        Raises ValueError (and changes nothing) if any index is not finished-and-untrained or
        appears twice.
        """
        bad = [i for i in task_indices if i not in self.finished]
        if bad or len(set(task_indices)) != len(task_indices):
            raise ValueError(f"tasks {task_indices} are not all finished and untrained: {bad}")
        oldest = {i: self.finished.pop(i) for i in task_indices}
        for i in task_indices:
            del self.admitted[i]
            self.trained_above_head.add(i)
        while self.head in self.trained_above_head:
            self.trained_above_head.remove(self.head)
            self.head += 1
        return oldest

    def requeue(self, task_index: int) -> None:
        """Send an admitted, unfinished index back to `pending` (its rollouts must re-run)."""
        if task_index in self.finished or task_index not in self.admitted:
            raise ValueError(f"task {task_index} is not in flight")
        del self.admitted[task_index]
        self.ended.pop(task_index, None)
        self.pending = sorted({*self.pending, task_index})

    # ---- persistence --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-serialisable state (dict keys become strings; finish order is a list)."""
        return {
            "group_size": self.group_size, "num_tasks": self.num_tasks,
            "next_index": self.next_index, "admitted": sorted(self.admitted.items()),
            "finished": list(self.finished.items()), "head": self.head,
            "trained_above_head": sorted(self.trained_above_head), "pending": self.pending,
            "ended": sorted((i, c, v) for i, (c, v) in self.ended.items()),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> GenerationQueue:
        """Inverse of `state()`."""
        return cls(
            group_size=state["group_size"], num_tasks=state["num_tasks"],
            next_index=state["next_index"], admitted={i: v for i, v in state["admitted"]},
            finished={i: v for i, v in state["finished"]}, head=state["head"],
            trained_above_head=set(state["trained_above_head"]), pending=list(state["pending"]),
            ended={i: (c, v) for i, c, v in state["ended"]},
        )
