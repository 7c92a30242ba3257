"""Per-step agent statistics of trained rollouts (`forgerl.metrics.rollout_stats`) and their
console form (`agent_summary`), on a small synthetic group with hand-computed values.

Pins: tool-call rate counts rollouts with >= 1 parsed Hermes call; the valid-call rate is parsed
calls over `<tool_call>` blocks written (bad JSON and unclosed blocks are attempts that failed);
turns are model calls per rollout; prefix hits / misses come from `extends_previous` on the
second and later calls; aborted rollouts are left out.
"""

from __future__ import annotations

import math

from forgerl.gateway.renderers.tool_parsers import parse_tool_calls
from forgerl.metrics import agent_summary, rollout_stats
from forgerl.types import Completion, Trajectory

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
BAD_JSON = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 1 + 2}}\n</tool_call>'
UNCLOSED = '<tool_call>\n{"name": "calcul'


def completion(tokenizer, text: str, extends_previous: bool = False) -> Completion:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Completion(prompt_ids=[1, 2], completion_ids=ids, logprobs=[-0.5] * len(ids),
                      weight_versions=[0] * len(ids), weight_version=0, finish_reason="stop",
                      extends_previous=extends_previous)


def trajectory(i: int, completions: list[Completion], status: str = "finished") -> Trajectory:
    return Trajectory(id=f"t{i}", task_index=0, rollout_index=i, completions=completions,
                      reward=0.0, status=status)


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def test_rollout_stats_on_a_synthetic_group(tokenizer):
    c = lambda text, hit=False: completion(tokenizer, text, hit)  # noqa: E731
    group = [
        # a valid call, then the answer after the tool result (prompt extended: a hit)
        trajectory(0, [c(CALL), c("3", hit=True)]),
        # two blocks in one reply, one with bad JSON; then a rewritten context (a miss)
        trajectory(1, [c(f"{CALL}\n{BAD_JSON}"), c("3", hit=False)]),
        # a direct answer: no attempt
        trajectory(2, [c("The answer is 3.")]),
        # an attempt cut by max_tokens, then a valid call, then the answer (two hits)
        trajectory(3, [c(UNCLOSED), c(CALL, hit=True), c("3", hit=True)]),
        # aborted (cancelled; re-run on resume): not counted at all
        trajectory(4, [c(CALL), c(CALL, hit=True)], status="aborted"),
        # failed after one bad call: counted (it is trained under failed_rollouts = "penalty")
        trajectory(5, [c(BAD_JSON)], status="failed"),
    ]
    stats = rollout_stats(group, decoder(tokenizer), parse_tool_calls)
    # rollouts counted: 0, 1, 2, 3, 5; with >= 1 parsed call: 0, 1, 3
    assert stats["tool_call_rate"] == 3 / 5
    # parsed calls: 1 + 1 + 1 = 3; attempts: 1 + 2 + 0 + 2 + 1 = 6
    assert (stats["tool_calls"], stats["tool_call_attempts"]) == (3.0, 6.0)
    assert stats["tool_call_valid_rate"] == 0.5
    # model calls: 2 + 2 + 1 + 3 + 1 = 9 over 5 rollouts
    assert stats["turns_per_trajectory"] == 9 / 5
    # later calls: rollout 0 one hit, 1 one miss, 3 two hits
    assert (stats["prefix_hits"], stats["prefix_misses"]) == (3.0, 1.0)
    assert agent_summary(stats) == "tools 0.60 valid 0.50 turns 1.80 prefix 3/1"


def test_rollout_stats_without_attempts_or_rollouts(tokenizer):
    stats = rollout_stats([trajectory(0, [completion(tokenizer, "3")])], decoder(tokenizer),
                          parse_tool_calls)
    assert stats["tool_call_rate"] == 0.0 and stats["turns_per_trajectory"] == 1.0
    assert math.isnan(stats["tool_call_valid_rate"])
    assert agent_summary(stats) == "tools 0.00 valid - turns 1.00 prefix 0/0"
    empty = rollout_stats([], decoder(tokenizer), parse_tool_calls)
    assert (empty["tool_call_rate"], empty["turns_per_trajectory"], empty["tool_calls"]) == (
        0.0, 0.0, 0.0)
    assert agent_summary({}) == "tools - valid - turns - prefix -/-"
    # C24: infrastructure aborts show on the progress line only when there are any
    assert agent_summary({"rollouts_aborted_infra": 0}) == "tools - valid - turns - prefix -/-"
    assert agent_summary({"rollouts_aborted_infra": 2}).endswith("prefix -/- infra 2")
