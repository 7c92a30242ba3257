"""One policy's view of a group, for runs that train several policies ([[policies]]).

Data flow: the gateway records every call under the policy its model name names
(`Completion.policy`) and the episode may give one reward per policy
(`Trajectory.policy_rewards`); `policy_group` turns a finished group into the group that
policy's trainer trains on, so its advantages come from its own group (advantages.py):

    Â_j = R_j^p - mean_{i in G_p} R_i^p,   G_p = the group's episodes in which p made a call

where R^p is p's own reward. Another policy's calls stay in the trajectory as context only.
"""

from __future__ import annotations

import dataclasses

from forgerl.types import Group


def policy_group(group: Group, policy: str, first: bool = False) -> Group:
    """The group as policy `policy` trains it: the trajectories in which it made at least one
    call, each with its own reward (`policy_rewards[policy]`, else the trajectory's `reward`)
    and every other policy's calls kept as context (`train = False`).

    first: `policy` is the run's first policy, which also owns the calls recorded without a
    policy ("" : pools written before policies). A trajectory without any call of `policy`
    is no member of its group (as a rollout without a model call is none of any group).
    """
    def own(policy_of_call: str) -> bool:
        return policy_of_call == policy or (first and policy_of_call == "")

    members = []
    for traj in group.trajectories:
        if not any(own(c.policy) for c in traj.completions):
            continue
        rewards = traj.policy_rewards or {}
        members.append(dataclasses.replace(
            traj, reward=rewards.get(policy, traj.reward),
            completions=[c if own(c.policy) else dataclasses.replace(c, train=False)
                         for c in traj.completions]))
    return Group(group.task_index, members)
