"""The trainer: finished groups → one optimizer step of CISPO on a prefix-tree-packed batch.

Data flow (DESIGN.md): groups from the scheduler → per-turn advantages (group baseline,
reward-to-go) → token-exact samples with a loss mask → one prefix tree over all samples of all
groups (shared prefixes stored once) → per row: forward, gather behavior logprobs and advantages,
CISPO loss divided by the global loss-token count, backward (gradient accumulation over rows)
→ gradient clipping → AdamW step. `step` counts optimizer steps and is the weight_version the
engines get after weight sync. Each trained token's policy logprob uses the temperature its
completion was sampled at (`TrainingSample.temperatures`), so ratios are 1 on unchanged weights
whatever mix of temperatures a batch holds. With a drafter (`attach_drafter`), each row's
final hidden states (detached) also train the speculative-decoding MTP head (forgerl/drafter.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from forgerl.cpu_share import CpuShare
from forgerl.drafter import PREFIX, Drafter, drafter_loss
from forgerl.models import engine_dtype, router_modules
from forgerl.trainer.advantages import composite_rewards, group_members, reward_advantages
from forgerl.trainer.attention import attn_implementation
from forgerl.trainer.lora import PolicyAdapter
from forgerl.trainer.losses import LossFn, cispo_loss, nll_loss
from forgerl.trainer.prefix_tree import TreeBatch, TreeRow, build_tree_batch
from forgerl.trainer.routing_replay import replay_routes, routes_tensor
from forgerl.trainer.samples import (
    TraceMode,
    TrainingSample,
    drop_retry_orphans,
    trace_counts,
    trajectory_to_samples_with_stats,
)
from forgerl.trainer.tree_forward import (
    checked_attn_implementation,
    forward_logprobs_entropy,
    supports_chunked_logprobs,
)
from forgerl.types import Group, RewardWeights, Trajectory

log = logging.getLogger(__name__)


@dataclass
class PreparedBatch:
    """Everything one step's loss needs, built before any forward pass.

    samples: the trained samples (all groups). tree: their packed prefix tree (each prediction
    with its sampling temperature).
    num_loss_tokens: the global loss normaliser N (Σ loss_mask over samples; CASES.md C07).
    behavior_logprobs / advantages / weight_versions: (Σ T_s,) flat over samples, indexed by
    `offsets[s] + t`. metrics: data metrics known before the forward (rewards, counts).
    """

    samples: list[TrainingSample]
    tree: TreeBatch
    num_loss_tokens: int
    offsets: Tensor
    behavior_logprobs: Tensor
    advantages: Tensor
    weight_versions: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    entropy_sums: Tensor | None = None
    """(len(samples),) float64: Σ policy entropy over each sample's loss tokens, filled by
    `accumulate_gradients`."""


class NonFiniteStep(RuntimeError):
    """A training step's loss or gradient norm is NaN or infinite; nothing was applied."""


class Trainer:
    """Owns the policy model and its AdamW optimizer; `train_step` is one RL update.

    Args:
        model: a HF causal LM (fp32), moved to `device` (in place) and put in train mode here.
        lr, weight_decay: AdamW settings. max_grad_norm: global L2 clip (≤ 0 disables).
        loss_fn: `(policy_logprobs, behavior_logprobs, advantages, num_loss_tokens) -> (loss,
            stats)`; default `losses.cispo_loss` with its default clip bounds.
        max_row_tokens: capacity of one packed row (one forward+backward).
        merge_prefixes: share common prefixes across samples (False = plain packing).
        normalize_std: divide advantages by the group's return std (`advantages`).
        failed_reward: outcome reward of a failed rollout, which then counts in its group's
            baseline and the loss; None drops failed rollouts from both; aborted ones, and
            failed ones without a model call, never count (`advantages.group_members`).
        rewards: the composite reward weights (`forgerl.rewards.composite`; default: the
            outcome alone, plus any agent turn rewards).
        mask_truncated: keep turns that ended at max_tokens out of the loss (context only).
        traces: which traces of a trajectory are trained (`samples.trained_traces`):
            "broadcast" (each with a `train` turn, all with the trajectory's advantage) or
            "main" (the one with the most sampled tokens).
        routing_replay: for a MoE model, run each token through the experts the engine
            recorded for it (`routing_replay`, R3); tokens without a record, and every token of
            a dense model, use the model's own routing.
        logprob_chunk_tokens: policy logprobs from the final hidden states in chunks of this
            many predictions, recomputed in the backward (`tree_forward.forward_logprobs`): no
            (tokens, vocab) logits are held. 0 = the model's own forward over all predictions;
            a family whose logit transform the chunked head does not reproduce falls back to
            0 (`tree_forward.supports_chunked_logprobs`, logged).
        activation_checkpointing: "off"; "full" recomputes every decoder layer in the backward
            (only layer inputs are kept); "selective" every `checkpoint_every_layers`-th layer
            (transformers' `activation_checkpointing_enable`, non-reentrant).
        autocast: "off", "bfloat16" or "auto" (`models.engine_dtype`): the policy
            forwards run under `torch.autocast` in that dtype; parameters, gradients and AdamW
            stay in the model's dtype, the returned logprobs are float32.
        device: "auto" (CUDA when available, else CPU), "cpu" or "cuda". Tree rows use
            FlexAttention on CUDA, else block-sparse tree attention over sdpa (or the model's
            own eager attention with a dense mask; `tree_forward.checked_attn_implementation`),
            set only around the trainer's own forwards (the engine's copy keeps its attention).

    Attribute `domain_of` (default None): task_index -> [[domains]] name, set by the
    controller; the step's metrics then hold `domain_<name>_entropy`.
    Attribute `cpu_share` (default None): a `forgerl.cpu_share.CpuShare` that the controller
    sets beside a local CPU engine; a step then runs as "trainer", each row at half of the
    CPU's threads while the engine decodes.

    Raises:
        ValueError: device "cuda" without CUDA, an unknown device, a model whose forward
            cannot give prefix-tree logprobs (`tree_forward.check_tree_support`, one line), or
            activation checkpointing asked of a model without support for it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        loss_fn: LossFn = cispo_loss,
        max_row_tokens: int = 4096,
        merge_prefixes: bool = True,
        normalize_std: bool = False,
        failed_reward: float | None = 0.0,
        device: str = "auto",
        rewards: RewardWeights | None = None,
        mask_truncated: bool = False,
        logprob_chunk_tokens: int = 256,
        activation_checkpointing: str = "off",
        checkpoint_every_layers: int = 2,
        autocast: str = "off",
        traces: TraceMode = "broadcast",
        routing_replay: bool = True,
    ) -> None:
        self.device = resolve_device(device)
        half = engine_dtype(autocast, self.device) if autocast != "off" else torch.float32
        self.autocast_dtype = half if half != torch.float32 else None
        self.model = model.to(self.device).train()
        self.attn_implementation = checked_attn_implementation(self.model, self.device,
                                                               max_row_tokens)
        with attn_implementation(self.model, self.attn_implementation):
            self.logprob_chunk_tokens = logprob_chunk_tokens
            if logprob_chunk_tokens and not supports_chunked_logprobs(self.model):
                log.warning("chunked logprobs do not match this model's forward: chunking off")
                self.logprob_chunk_tokens = 0
        set_activation_checkpointing(self.model, activation_checkpointing,
                                     checkpoint_every_layers)
        self._checkpointing = (activation_checkpointing, checkpoint_every_layers)
        # the fused AdamW kernel makes no transient tensors; the per-tensor one allocates a
        # parameter-sized temporary per op, which glibc returns to the OS and faults back in
        # every step
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
            fused=True if self.device.type in ("cpu", "cuda") else None,
        )
        self.max_grad_norm = max_grad_norm
        self.loss_fn = loss_fn
        self.max_row_tokens = max_row_tokens
        self.merge_prefixes = merge_prefixes
        self.normalize_std = normalize_std
        self.failed_reward = failed_reward
        self.rewards = rewards or RewardWeights()
        self.mask_truncated = mask_truncated
        self.traces: TraceMode = traces
        self.routing_replay = routing_replay and bool(router_modules(self.model))
        self.cpu_share: CpuShare | None = None  # set by the controller beside a local engine
        self.domain_of: Callable[[int], str] | None = None  # set by the controller: [[domains]]
        self.step = 0
        self.drafter: Drafter | None = None
        self._hidden: Tensor | None = None
        self.lora: PolicyAdapter | None = None

    def attach_lora(self, adapter: PolicyAdapter) -> None:
        """Train `adapter` (`forgerl.trainer.lora`: a LoRA adapter on this trainer's model,
        whose base is frozen) instead of the model: AdamW, with the same settings, over the
        adapter's A and B only; every policy forward under `adapter.active()` (activation
        checkpointing's recompute too, which may run on another thread); `state_dict_for_sync`
        gives the merged weights of the adapted Linears and checkpoints hold the adapter."""
        self.lora = adapter
        defaults = {k: v for k, v in self.optimizer.defaults.items()
                    if k in ("lr", "betas", "eps", "weight_decay", "fused")}
        self.optimizer = torch.optim.AdamW(adapter.parameters(), **defaults)
        set_activation_checkpointing(self.model, *self._checkpointing,
                                     context=adapter.active)

    def attach_drafter(self, drafter: Drafter, lr: float = 1e-3, top_k: int = 16) -> None:
        """Train `drafter` (an MTP head, `forgerl.drafter`) in every later step: per tree row,
        `drafter_loss` (top-`top_k` KL to the policy's next-token distribution at the row's
        prediction positions) on the final hidden states of the policy's own forward, detached
        (the policy's loss and gradients are unchanged), with an AdamW of its own (`lr`, no
        clipping). Its tensors join `state_dict_for_sync` as `drafter.<name>`; step metrics
        gain drafter_kl, drafter_top1 (top-1 agreement with the policy: an acceptance proxy)
        and drafter_seconds."""
        self.drafter = drafter.to(self.device).train()
        self.drafter_top_k = top_k
        self.drafter_optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)

        decoder = self.model.get_decoder()

        def keep(module: torch.nn.Module, _args: object, output: object) -> None:
            if module is decoder:  # a deepcopy of the model (a local engine's) keeps this hook
                self._hidden = output.last_hidden_state  # type: ignore[attr-defined]
        decoder.register_forward_hook(keep)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on `groups`; returns metrics (floats).

        Metrics: loss, reward_mean, advantage_abs_mean (over loss tokens), num_loss_tokens,
        tokens_before_merge / tokens_after_merge, grad_norm (before clipping), ratio_mean /
        ratio_max / clip_frac, token_off_policy_lag_mean / _max (self.step - weight_versions
        over loss tokens; the scheduler logs the per-group lag), groups_skipped (all advantages
        0), prefix_extensions / prefix_branches, greedy_turns (temperature-0 turns kept out of
        the loss, `samples`), transformed_turns (turns sampled with top_p, top_k, min_p or a
        penalty, kept out of the loss, `samples`), truncated_turns / truncated_turns_masked
        (finish "length" turns of trained groups, and those kept out of the loss), retry_orphans
        (`samples.drop_retry_orphans`), traces_per_trajectory (mean over the groups' members)
        and traces_untrained (their traces left out: `samples.trained_traces`), the composite
        reward's per-member means over the step's groups (reward_outcome_mean,
        reward_process_mean summed over turns, reward_completion_time_mean,
        rollout_seconds_mean), events_<kind> (summed event values), step_seconds,
        tokens_per_second (tree tokens through forward+backward per second), entropy_mean (the
        mean over loss tokens of the policy's entropy, in nats, of the distribution each token
        was sampled from, i.e. at its sampling temperature: `tree_forward.entropy_of`) and,
        with `domain_of`, domain_<name>_entropy; nonfinite_tokens (loss tokens dropped by the
        non-finite rule: a NaN/inf recorded logprob or advantage, `pack`, or policy logprob,
        `losses`) and nonfinite_rewards (group members dropped from baseline and loss for a
        NaN/inf reward). With `routing_replay` on a MoE model: replayed_tokens (tree tokens
        run through their recorded experts) and unrouted_turns (turns without a record, run
        with the model's own routing).
        With no loss tokens at all no optimizer step is taken and `step` is unchanged. If the
        step raises, gradients are cleared, no optimizer step is taken and `step` is unchanged:
        so it is for NonFiniteStep, a NaN or infinite loss or gradient norm (e.g. rewards of
        1e38), which must never reach the weights, the engine or a checkpoint.
        """
        return self._optimize(lambda: self.prepare(groups), self.loss_fn)

    def supervised_step(self, samples: list[TrainingSample]) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on `samples` (the warm start,
        `controller.warmstart`): the token-mean NLL of their loss tokens (`losses.nll_loss`) over
        their prefix tree. Metrics as `train_step`'s that do not depend on rewards (loss,
        num_loss_tokens, tokens_before_merge / _after_merge, grad_norm, step_seconds, ...)."""
        return {k: v for k, v in self._optimize(lambda: self.pack(samples, {}), nll_loss).items()
                if "off_policy_lag" not in k}  # no behavior policy, no lag

    def _optimize(self, build: Callable[[], PreparedBatch], loss_fn: LossFn) -> dict[str, float]:
        """build() → forward/backward of every row with `loss_fn` → clip → AdamW step."""
        start = time.perf_counter()
        share = self.cpu_share.busy("trainer") if self.cpu_share else contextlib.nullcontext()
        with share:  # the engine's decode thread runs on half of the cores meanwhile
            try:
                batch = build()
                metrics = dict(batch.metrics)
                metrics.update(self.accumulate_gradients(batch, loss_fn))
                metrics.update(self._entropy_metrics(batch))
                if batch.num_loss_tokens > 0:
                    params = [p for g in self.optimizer.param_groups for p in g["params"]]
                    clip = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
                    norm = torch.nn.utils.clip_grad_norm_(params, clip)  # a DTensor under FSDP
                    if hasattr(norm, "full_tensor"):
                        norm = norm.full_tensor()
                    metrics["grad_norm"] = norm.item()
                    if not all(map(math.isfinite, (metrics["grad_norm"], metrics["loss"]))):
                        raise NonFiniteStep(
                            f"step {self.step + 1}: the loss ({metrics.get('loss')}) or the "
                            f"gradient norm ({metrics['grad_norm']}) is not finite, so no "
                            "optimizer step was taken and the weights stay as they were (check "
                            "the reward scale: mean |advantage| "
                            f"{metrics.get('advantage_abs_mean', float('nan')):.3g})")
                    self.optimizer.step()
                    if self.drafter is not None:
                        self.drafter_optimizer.step()
                    self.step += 1
                else:
                    metrics["grad_norm"] = 0.0
            finally:  # a step that raises leaves no partial gradients for the next one
                self.optimizer.zero_grad(set_to_none=True)
                if self.drafter is not None:
                    self.drafter_optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        metrics["step_seconds"] = seconds
        metrics["tokens_per_second"] = batch.tree.num_tree_tokens / max(seconds, 1e-9)
        return metrics

    def prepare(self, groups: list[Group]) -> PreparedBatch:
        """Advantages → samples → prefix tree, plus the global loss-token count N."""
        samples: list[TrainingSample] = []
        rewards: list[float] = []
        skipped = extensions = branches = greedy = transformed = orphans = truncated = masked = 0
        unrouted = 0
        traces = untrained = nonfinite = 0
        parts: dict[str, float] = {}
        events: dict[str, float] = {}
        for recorded in groups:
            finite = [t for t in recorded.trajectories if _finite_rewards(t)]
            nonfinite += len(recorded.trajectories) - len(finite)
            rewards += [t.reward for t in finite if t.reward is not None]
            cleaned = [drop_retry_orphans(t) for t in finite]
            orphans += sum(n for _, n in cleaned)
            group = replace(recorded, trajectories=[t for t, _ in cleaned])
            trajs = group_members(group, self.failed_reward)
            outcome_G, process_G_T, sums = composite_rewards(trajs, self.rewards,
                                                             self.failed_reward)
            advs_G = reward_advantages(outcome_G, process_G_T, self.normalize_std,
                                       traces_G_T=[[c.trace for c in t.completions]
                                                   for t in trajs])
            members = list(zip(trajs, advs_G, strict=True))
            for n, left_out in (trace_counts(t, self.traces) for t in trajs):
                traces, untrained = traces + n, untrained + left_out
            for key, total in sums.items():
                parts[key] = parts.get(key, 0.0) + total
            parts["members"] = parts.get("members", 0.0) + len(trajs)
            for e in (e for t in trajs for e in t.events):
                events[e.kind] = events.get(e.kind, 0.0) + e.value
            if all(a == 0.0 for _, advs in members for a in advs):
                skipped += 1  # no learning signal: contributes no loss tokens
                continue
            for traj, advs in members:
                traj_samples, stats = trajectory_to_samples_with_stats(
                    traj, advs, self.mask_truncated, self.traces)
                samples += [s for s in traj_samples if any(s.loss_mask)]
                extensions, branches = extensions + stats.extensions, branches + stats.branches
                greedy += stats.greedy_turns
                transformed += stats.transformed_turns
                truncated += stats.truncated_turns
                masked += stats.truncated_masked
                unrouted += stats.unrouted_turns
        return self.pack(samples, {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "groups_skipped": float(skipped),
            "prefix_extensions": float(extensions),
            "prefix_branches": float(branches),
            "greedy_turns": float(greedy),
            "transformed_turns": float(transformed),
            "truncated_turns": float(truncated),
            "truncated_turns_masked": float(masked),
            "retry_orphans": float(orphans),
            "traces_per_trajectory": traces / max(parts.get("members", 0.0), 1.0),
            "traces_untrained": float(untrained),
            "nonfinite_rewards": float(nonfinite),
            **{name: parts.get(key, 0.0) / max(parts.get("members", 0.0), 1.0) for name, key in (
                ("reward_outcome_mean", "outcome"), ("reward_process_mean", "process"),
                ("reward_completion_time_mean", "completion_time"),
                ("rollout_seconds_mean", "seconds"))},
            **{f"events_{kind}": v for kind, v in sorted(events.items())},
            **({"unrouted_turns": float(unrouted)} if self.routing_replay else {}),
        })

    def pack(self, samples: list[TrainingSample], metrics: dict[str, float]) -> PreparedBatch:
        """Samples → their prefix tree and flat per-token tensors; `metrics` gets the token
        counts and off-policy lag added. A loss token whose recorded behavior logprob or
        advantage is NaN or ±inf leaves the loss (loss_mask 0, out of N) and is counted in
        nonfinite_tokens (`losses`' non-finite rule). Raises ValueError for a sample longer
        than max_row_tokens."""
        samples, dropped = _drop_nonfinite_tokens(samples)
        for s in samples:  # a sample is as long as its last turn's prompt + completion
            if len(s.input_ids) > self.max_row_tokens:
                raise ValueError(
                    f"trajectory {s.trajectory_id}: a turn of {len(s.input_ids)} tokens (prompt"
                    f" + completion) exceeds trainer.max_row_tokens ({self.max_row_tokens})"
                )
        tree = build_tree_batch(
            [s.input_ids for s in samples],
            self.max_row_tokens,
            needed=[[m == 1 for m in s.loss_mask] for s in samples],
            merge=self.merge_prefixes,
            temperatures=[s.temperatures for s in samples],
            routes=[routes_tensor(s.routes) if s.routes and self.routing_replay else None
                    for s in samples],
        )
        lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
        offsets = torch.cumsum(lengths, 0) - lengths
        mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool)
        advantages = torch.tensor([a for s in samples for a in s.advantages])
        versions = torch.tensor([v for s in samples for v in s.weight_versions], dtype=torch.long)
        lag = (self.step - versions[mask]).float()
        num_loss_tokens = int(mask.sum())
        metrics = {
            **metrics,
            "advantage_abs_mean": advantages[mask].abs().mean().item() if num_loss_tokens else 0.0,
            "num_loss_tokens": float(num_loss_tokens),
            "num_samples": float(len(samples)),
            "tokens_before_merge": float(tree.num_input_tokens),
            "tokens_after_merge": float(tree.num_tree_tokens),
            "token_off_policy_lag_mean": lag.mean().item() if num_loss_tokens else 0.0,
            "token_off_policy_lag_max": lag.max().item() if num_loss_tokens else 0.0,
            "nonfinite_tokens": float(dropped),
        }
        return PreparedBatch(
            samples=samples,
            tree=tree,
            num_loss_tokens=num_loss_tokens,
            offsets=offsets,
            behavior_logprobs=torch.tensor([x for s in samples for x in s.behavior_logprobs]),
            advantages=advantages,
            weight_versions=versions,
            metrics=metrics,
            entropy_sums=torch.zeros(len(samples), dtype=torch.float64),
        )

    def _adapter(self) -> contextlib.AbstractContextManager:
        """The LoRA adapter active on this thread (`attach_lora`), or nothing."""
        return self.lora.active() if self.lora else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        """torch.autocast in `autocast_dtype` on the trainer's device, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def accumulate_gradients(self, batch: PreparedBatch,
                             loss_fn: LossFn | None = None) -> dict[str, float]:
        """Forward + backward of every row, accumulating gradients (no optimizer step).

        `loss_fn`: default `self.loss_fn`. Each row's loss is divided by the global N, so the
        summed row losses and their gradients equal the single-pass token-mean loss whatever
        the row split (CASES.md C07). Returns loss and the ratio statistics aggregated over all
        loss tokens."""
        total_loss, ratio_sum, ratio_max, clipped, kept, nonfinite = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        replayed = 0
        if batch.num_loss_tokens == 0:
            return {"loss": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "clip_frac": 0.0}
        drafted: dict[str, float] = {}
        for row in batch.tree.rows:
            if row.pred_pos.numel() == 0:
                continue
            if self.cpu_share is not None:  # the engine may have gone idle or busy since
                self.cpu_share.enter("trainer")
            flat = batch.offsets[row.sample_idx] + row.token_idx  # (K,)
            # the backward too: activation checkpointing recomputes layers, with this attention
            # and these routes
            with attn_implementation(self.model, self.attn_implementation), replay_routes(
                    self.model, row.routes) as n_replayed, self._adapter():
                replayed += n_replayed
                with self._autocast():
                    policy_logprobs, entropy = forward_logprobs_entropy(
                        self.model, row, self.logprob_chunk_tokens)
                loss, stats = (loss_fn or self.loss_fn)(
                    policy_logprobs,
                    batch.behavior_logprobs[flat].to(self.device),
                    batch.advantages[flat].to(self.device),
                    batch.num_loss_tokens,
                )
                loss.backward()
            self._train_drafter(row, len(batch.tree.rows), drafted)
            total_loss += loss.item()
            ratio_sum += stats["ratio_mean"] * stats["num_tokens"]
            ratio_max = max(ratio_max, stats["ratio_max"])
            clipped += stats["clip_frac"] * stats["num_tokens"]
            kept += stats["num_tokens"]
            nonfinite += stats["nonfinite_tokens"]
            if batch.entropy_sums is not None:
                entropy = torch.where(entropy.isfinite(), entropy, 0.0).double().cpu()
                batch.entropy_sums.index_add_(0, row.sample_idx, entropy)
        return {
            "loss": total_loss,
            "ratio_mean": ratio_sum / max(kept, 1.0),
            "ratio_max": ratio_max,
            "clip_frac": clipped / max(kept, 1.0),
            "nonfinite_tokens": batch.metrics.get("nonfinite_tokens", 0.0) + nonfinite,
            **({"replayed_tokens": float(replayed)} if self.routing_replay else {}),
            **{k: v / drafted["drafter_positions"] if k in ("drafter_kl", "drafter_top1") else v
               for k, v in drafted.items() if drafted.get("drafter_positions")},
        }

    def _train_drafter(self, row: TreeRow, rows: int, acc: dict[str, float]) -> None:
        """Backward of the drafter's loss on this row's hidden states (`attach_drafter`), its
        metrics summed into `acc` (KL and top-1 weighted by positions)."""
        if self.drafter is None or self._hidden is None:
            return
        start, dev = time.perf_counter(), self.device
        loss, stats = drafter_loss(self.drafter, self.model, self._hidden[0],
                                   row.input_ids.to(dev), row.parent.to(dev),
                                   torch.unique(row.pred_pos).to(dev), self.drafter_top_k)
        if stats:
            (loss / rows).backward()
            n = stats["drafter_positions"]
            for key, value in (("drafter_kl", stats["drafter_kl"] * n),
                               ("drafter_top1", stats["drafter_top1"] * n),
                               ("drafter_positions", n)):
                acc[key] = acc.get(key, 0.0) + value
        self._hidden = None
        acc["drafter_seconds"] = acc.get("drafter_seconds", 0.0) + time.perf_counter() - start

    def _entropy_metrics(self, batch: PreparedBatch) -> dict[str, float]:
        """entropy_mean over all loss tokens and, with `domain_of`, domain_<name>_entropy over
        each domain's (from `batch.entropy_sums`; 0.0 without loss tokens)."""
        if batch.entropy_sums is None or batch.num_loss_tokens == 0:
            return {"entropy_mean": 0.0}
        sums: dict[str, list[float]] = {}
        for s, total in zip(batch.samples, batch.entropy_sums.tolist(), strict=True):
            name = self.domain_of(s.task_index) if self.domain_of else ""
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + total, acc[1] + sum(s.loss_mask)
        out = {"entropy_mean": float(batch.entropy_sums.sum()) / batch.num_loss_tokens}
        return out | {f"domain_{d}_entropy": a / n for d, (a, n) in sorted(sums.items())
                      if d and n}

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(model state dict, optimizer state dict) to save in a checkpoint; with a LoRA
        adapter the model's part is empty (the adapter is saved in peft's format)."""
        return ({} if self.lora else self.model.state_dict()), self.optimizer.state_dict()

    def drafter_state(self) -> dict | None:
        """{"weights", "optimizer"} state dicts of the drafter to checkpoint; None without one."""
        if self.drafter is None:
            return None
        return {"weights": self.drafter.state_dict(),
                "optimizer": self.drafter_optimizer.state_dict()}

    def load_drafter_state(self, state: dict) -> None:
        """Restore `drafter_state` into the attached drafter and its optimizer."""
        assert self.drafter is not None, "attach_drafter first"
        self.drafter.load_state_dict(state["weights"])
        self.drafter_optimizer.load_state_dict(state["optimizer"])

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """The model's weights for weight sync: {name: detached tensor} (shares storage, on the
        trainer's device; `LocalEngine.update_weights` copies across devices). With a LoRA
        adapter (`attach_lora`): only the adapted Linears' merged weights (`PolicyAdapter.merged`),
        new tensors."""
        weights = (self.lora.merged() if self.lora
                   else {k: v.detach() for k, v in self.model.state_dict().items()})
        if self.drafter is not None:  # the engine's drafter follows the trainer's
            weights |= {PREFIX + k: v.detach() for k, v in self.drafter.state_dict().items()}
        return weights


def _finite_rewards(traj: Trajectory) -> bool:
    """Whether `traj`'s reward and turn rewards are all finite (or absent)."""
    values = [traj.reward if traj.reward is not None else 0.0, *(traj.turn_rewards or ())]
    return all(map(math.isfinite, values))


def _drop_nonfinite_tokens(samples: list[TrainingSample]) -> tuple[list[TrainingSample], int]:
    """`samples` with every loss token whose behavior logprob or advantage is not finite moved
    out of the loss (mask 0, the context values of `samples._append`), and how many."""
    out, dropped = [], 0
    for s in samples:
        bad = [t for t, m in enumerate(s.loss_mask) if m and not (
            math.isfinite(s.behavior_logprobs[t]) and math.isfinite(s.advantages[t]))]
        if bad:
            s = replace(s, loss_mask=list(s.loss_mask), behavior_logprobs=list(
                s.behavior_logprobs), advantages=list(s.advantages),
                weight_versions=list(s.weight_versions), temperatures=list(s.temperatures))
            for t in bad:
                s.loss_mask[t], s.behavior_logprobs[t], s.advantages[t] = 0, 0.0, 0.0
                s.weight_versions[t], s.temperatures[t] = -1, 1.0
        out.append(s)
        dropped += len(bad)
    return out, dropped


def set_activation_checkpointing(model: torch.nn.Module, mode: str, every: int,
                                 context: Callable[[], contextlib.AbstractContextManager] | None
                                 = None) -> None:
    """Activation checkpointing of `model`'s decoder layers: "off", "full" (every layer) or
    "selective" (layers 0, every, 2·every, ...). Non-reentrant `torch.utils.checkpoint`, so
    the tree mask and position ids reach the recompute unchanged; active only in train mode
    with gradients (the engine's eval copy never recomputes). `context()`: entered around each
    recompute (a LoRA adapter's `active`: the backward may run on another thread). ValueError:
    an unknown mode, or a model that does not support it."""
    if mode not in ("off", "full", "selective"):
        raise ValueError(f"activation_checkpointing must be off, full or selective, got {mode!r}")
    if mode == "off":
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    kwargs: dict = {"use_reentrant": False}
    if context is not None:
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), context())
    model.activation_checkpointing_enable(kwargs, every_n_layers=1 if mode == "full" else every)
    model.disable_input_require_grads()  # only reentrant checkpointing needs grad-carrying inputs


def resolve_device(device: str) -> torch.device:
    """ "auto" → CUDA when available, else CPU; "cpu" / "cuda" as given (ValueError: "cuda"
    without CUDA, or any other value)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device = 'cuda' but CUDA is not available; use 'auto' or 'cpu'")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return torch.device(device)
