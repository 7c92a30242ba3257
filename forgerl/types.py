"""The few records shared by every ForgeRL service (DESIGN.md "Key definitions").

Data flow: the gateway turns each LLM call into a `Completion`; the completions of one agent
episode form a `Trajectory`; the G trajectories of one task form a `Group`; the trainer turns
groups into `Sample`s (token-exact training rows). Records are plain dataclasses so they cross
process boundaries (pickle, JSON) without pydantic; pydantic lives only at the HTTP edge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls", "abort"]
TrajectoryStatus = Literal["running", "finished", "failed", "aborted", "aborted_infra"]
NOT_TRAINED = ("aborted", "aborted_infra")  # never trained nor in a baseline (runner.infra_cause)


@dataclass(frozen=True)
class SamplingParams:
    """How one completion is sampled: vLLM's names, conventions and order (CASES.md C04, C21).

    Every engine gets every field explicitly, so no model default (generation_config's top_k 20,
    repetition_penalty 1.1, ...) applies unseen. Per token: penalties on the raw logits, then
    temperature, min_p, top_k, top_p; the recorded logprob is log_softmax of the result, the
    distribution actually sampled (a filter renormalises over the tokens kept).

    temperature: >= 0; 0 means greedy (argmax of the penalised logits, logprobs at T = 1, no
        filter, as vLLM).
    top_p: nucleus mass in (0, 1]; 1 = off.
    top_k: the k most likely tokens (ties kept); 0 or -1 = off (vLLM's convention; 0 stored).
    min_p: in [0, 1]; tokens below min_p times the top token's probability are dropped; 0 = off.
    repetition_penalty: > 0; a token already in the prompt or the completion has its logit
        divided by it when positive, multiplied when not; 1 = off.
    presence_penalty / frequency_penalty: in [-2, 2]; subtracted once per token present in the
        completion so far / once per occurrence in it (the prompt is not counted); 0 = off.
    max_tokens: upper bound on completion tokens (already clamped to the context by the gateway).
    stop_token_ids: ids that end the completion (the end-of-turn id); the stop id is included
        in `completion_ids` and gets a logprob like any other sampled token.
    seed: optional per-request seed for reproducible sampling.

    The trainer scores tokens with log_softmax(logits / T) only: a turn sampled with any
    `transforms()` is context only (loss mask 0), counted (trainer/samples.py).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def transforms(self) -> tuple[str, ...]:
        """Names of the fields set to a non-neutral value (top_p, top_k, min_p, penalties): the
        sampled distribution is then not log_softmax(logits / T). Empty when none is."""
        off = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
               "presence_penalty": 0.0, "frequency_penalty": 0.0}
        return tuple(k for k, v in off.items()
                     if getattr(self, k) != v and not (k == "top_k" and self.top_k == -1))

    def check(self) -> None:
        """Raise ValueError naming the first field outside the bounds of the class docstring
        (vLLM's; max_tokens >= 1)."""
        for name, ok in (("temperature", self.temperature >= 0), ("top_p", 0 < self.top_p <= 1),
                         ("top_k", isinstance(self.top_k, int) and self.top_k >= -1),
                         ("min_p", 0 <= self.min_p <= 1),
                         ("repetition_penalty", 0 < self.repetition_penalty < math.inf),
                         ("presence_penalty", -2 <= self.presence_penalty <= 2),
                         ("frequency_penalty", -2 <= self.frequency_penalty <= 2),
                         ("max_tokens", self.max_tokens >= 1)):
            if not ok:
                raise ValueError(f"{name} ({getattr(self, name)}) is out of range")


@dataclass(frozen=True)
class Routes:
    """The experts a MoE model's routers chose for each token fed through it (R3 routing replay,
    "Stabilizing MoE RL by aligning training and inference routers", 2025).

    data: uint8 bytes, row-major (tokens, layers, top_k): token i's top_k expert ids (< 256) in
    each MoE layer, in the router's order. Token i is position i of prompt_ids + completion_ids.
    Raises ValueError when len(data) is not a multiple of layers * top_k.
    """

    data: bytes
    layers: int
    top_k: int

    def __post_init__(self) -> None:
        if self.layers < 1 or self.top_k < 1 or len(self.data) % (self.layers * self.top_k):
            raise ValueError(f"routes of {len(self.data)} bytes are not (tokens, {self.layers}, "
                             f"{self.top_k})")

    def __len__(self) -> int:
        """Tokens covered."""
        return len(self.data) // (self.layers * self.top_k)

    def cut(self, tokens: int) -> Routes:
        """The routes of the first `tokens` tokens (all of them when there are fewer)."""
        return Routes(self.data[: tokens * self.layers * self.top_k], self.layers, self.top_k)

    def to_blob(self) -> bytes:
        """`layers`, `top_k` (uint16 little-endian each), then `data`: the data pool's column."""
        return self.layers.to_bytes(2, "little") + self.top_k.to_bytes(2, "little") + self.data

    @classmethod
    def from_blob(cls, blob: bytes) -> Routes:
        """The inverse of `to_blob`."""
        return cls(bytes(blob[4:]), int.from_bytes(blob[:2], "little"),
                   int.from_bytes(blob[2:4], "little"))


@dataclass(frozen=True)
class GenerateOutput:
    """What a rollout engine returns for one request.

    completion_ids: sampled token ids, length C (C <= max_tokens), stop id included.
    logprobs: behavior-policy logprob of each sampled id, length C, float (nats).
    weight_versions: weight version that produced each token, length C (an update between
        decode steps splits a completion across versions: a partial rollout).
    finish_reason: "stop" (a stop id was sampled), "length" (max_tokens reached) or "abort".
    text: None, or the reply's text when the engine answered without token ids for it (a
        server that returns text only); the three lists are then empty, and the gateway
        answers the text and records the turn as not token-exact, out of the loss (CASES.md
        C01). Raises ValueError for lists of unequal lengths, or ids with a `text`.
    routed_experts: None for a dense model (or an engine that does not record them); for a MoE
        model the `Routes` of every token the engine fed through it: the P prompt tokens, then
        the completion tokens but the last (C - 1; the last sampled token is never fed, so it
        has none), P + C - 1 in all. A prefix reused from the prefix cache comes with the
        routes it was computed with; after a weight update mid-completion, those of the
        re-prefill under the new weights.
    """

    completion_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: FinishReason
    text: str | None = None
    routed_experts: Routes | None = None

    def __post_init__(self) -> None:
        if not (len(self.completion_ids) == len(self.logprobs) == len(self.weight_versions)):
            raise ValueError(
                f"completion_ids ({len(self.completion_ids)}), logprobs ({len(self.logprobs)}) "
                f"and weight_versions ({len(self.weight_versions)}) must have equal lengths"
            )
        if self.text is not None and self.completion_ids:
            raise ValueError("a text-only GenerateOutput (text set) has no completion_ids")


@dataclass
class Completion:
    """One LLM call, recorded token-in-token-out by the gateway.

    prompt_ids: the exact ids sent to the engine (length P).
    completion_ids / logprobs / weight_versions: as returned by the engine (length C each).
    weight_version: the engine's version when the request was dispatched (stamped at dispatch).
    finish_reason: as reported to the client ("tool_calls" when tool calls were parsed).
    sampling: the params used. started_at / ended_at: wall-clock seconds (time.time()).
    token_exact: False when ids were not available token-exact; such turns never enter the loss.
    extends_previous: True when prompt_ids extend the previous turn's prompt + completion.
    trace: which trace of its trajectory the call belongs to (0-based, in order of first call):
        a call that extends an earlier call of its session joins that call's trace; one that
        extends none (the first call, a title or compaction call, a sub-agent, a fork) starts
        the next trace. Each trace is its own prefix tree in the trainer.
    train: False keeps the call out of the loss (context only): a side call (an untrained
        model name, a trace rule). Sampling the trainer cannot reproduce
        (`SamplingParams.transforms`) is kept out by the trainer whatever this says.
    request: JSON-able notes on the request as the gateway applied it (protocol, fields kept
        without effect, controls applied approximately, tools left out); never affects tokens.
    routed_experts: a MoE engine's `GenerateOutput.routed_experts` cut to the recorded tokens
        (at most P + C; the trainer replays them, `trainer.routing_replay`); None for a dense
        model, an engine that does not record them, or a reply cut at a streamed stop string.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    weight_version: int
    finish_reason: FinishReason
    sampling: SamplingParams = field(default_factory=SamplingParams)
    started_at: float = 0.0
    ended_at: float = 0.0
    token_exact: bool = True
    extends_previous: bool = False
    trace: int = 0
    train: bool = True
    request: dict[str, Any] = field(default_factory=dict)
    routed_experts: Routes | None = None
    policy: str = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError unless len(completion_ids) == len(logprobs) ==
        len(weight_versions): one recorded logprob per sampled id, never padded (CASES.md
        C01). Run on construction and by the data pool before it stores a completion."""
        if len(self.completion_ids) != len(self.logprobs):
            raise ValueError(
                f"len(completion_ids) ({len(self.completion_ids)}) != "
                f"len(logprobs) ({len(self.logprobs)}): a completion is stored only with one "
                "logprob per sampled id"
            )
        if len(self.weight_versions) != len(self.completion_ids):
            raise ValueError(
                f"len(weight_versions) ({len(self.weight_versions)}) != "
                f"len(completion_ids) ({len(self.completion_ids)})"
            )


@dataclass(frozen=True)
class Event:
    """A process event on one turn of a trajectory (Forge §4.2 process rewards).

    turn: 0-based index into the trajectory's completions. kind: a name such as
    "invalid_tool_call" (the gateway's built-ins) or any name an agent reports; `[reward]
    process` maps kinds to a reward per unit. value: units (default 1.0, e.g. one bad call).
    """

    turn: int
    kind: str
    value: float = 1.0


UNDELIVERED = "undelivered"
"""Event kind the gateway puts on a turn whose client left while the turn was being recorded
(it never received the answer): `samples.drop_retry_orphans` keeps such turns out of training."""


NO_CALL = "no recorded call"
"""Error of a trajectory whose session ended without any recorded call: failed, never trained."""


@dataclass
class Trajectory:
    """The ordered completions of one rollout plus its reward and status.

    id: unique string (also the gateway session id). task_index: position in the generation
    queue. rollout_index: 0..G-1 within the group. reward: outcome reward (None until scored).
    turn_rewards: optional per-turn process rewards (len == len(completions)), added to the
    outcome reward for reward-to-go. events: process events by turn (`Event`), weighted into
    per-turn rewards by `[reward] process`. started_at / ended_at: wall-clock seconds.
    policy_rewards: each policy's outcome reward (`[[policies]]` name → reward) when the episode
    gave one per agent; a policy not named there gets `reward`.
    """

    id: str
    task_index: int
    rollout_index: int
    completions: list[Completion] = field(default_factory=list)
    reward: float | None = None
    turn_rewards: list[float] | None = None
    status: TrajectoryStatus = "running"
    error: str | None = None
    started_at: float = 0.0
    ended_at: float = 0.0
    events: list[Event] = field(default_factory=list)
    policy_rewards: dict[str, float] | None = None


@dataclass(frozen=True)
class RewardWeights:
    """outcome: w_o, the verifier score's weight. completion_time: w_time (0 = off). process:
    reward per unit of each event kind (kinds not listed give 0 and are only counted)."""

    outcome: float = 1.0
    completion_time: float = 0.0
    process: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Limits:
    """Limits of one sandbox (forgerl/agents/sandbox.py); None: unlimited. cpu_s: CPU seconds of
    each process (RLIMIT_CPU: SIGXCPU, SIGKILL a second later). memory_mb and processes: the
    whole sandbox (cgroup memory / pids.max) where cgroups work, else each process (RLIMIT_AS)
    and the user (RLIMIT_NPROC). file_mb: largest file a process writes (RLIMIT_FSIZE: EFBIG)."""

    cpu_s: int | None = 600
    memory_mb: int | None = 4096
    processes: int | None = 512
    file_mb: int | None = 1024


@dataclass
class Group:
    """The G trajectories of one task: the baseline for advantages."""

    task_index: int
    trajectories: list[Trajectory]


@dataclass
class Sample:
    """One token-exact training row built from a trajectory (tinker's Datum).

    input_ids: length T. loss_mask: length T, 1 where the token at that position is a trained
    (sampled) token. behavior_logprobs: length T, the engine's logprob of input_ids[t] where
    loss_mask[t] == 1, else 0.0. advantages: length T, float, 0.0 where loss_mask == 0.
    weight_versions: length T, the behavior weight version per token (-1 where loss_mask == 0).
    task_index / trajectory_id: provenance, for metrics.
    Position t's logprob is predicted from the logits at position t-1, so loss_mask[0] == 0.
    """

    input_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    advantages: list[float]
    weight_versions: list[int]
    task_index: int = -1
    trajectory_id: str = ""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lens = (len(self.loss_mask), len(self.behavior_logprobs), len(self.advantages),
                len(self.weight_versions))
        if any(x != n for x in lens):
            raise ValueError(f"Sample fields must all have length {n}, got {lens}")
