"""Policy-gradient losses on per-token logprobs (pure tensor functions).

Data flow: the trainer recomputes `policy_logprobs` for the loss tokens of one packed row,
gathers the matching `behavior_logprobs` (from the engine) and advantages, and calls one of
these per row; the summed row losses are the step's loss because every function divides by
the GLOBAL number of loss tokens N of the whole batch, known before the row loop (CASES.md C07:
token-mean under gradient accumulation).

All inputs are 1-D tensors of shape (K,) over the K loss tokens in the call; only
`policy_logprobs` carries gradient. Ratios are r = exp(policy_logprobs - behavior_logprobs).
Clip bounds are deltas from 1 (STYLE.md): the ratio is clipped to [1 - eps_low, 1 + eps_high].
Each function returns (loss, stats) with loss a 0-dim tensor and stats plain floats:
ratio_mean, ratio_max, clip_frac (fraction of the kept tokens whose weight was clipped),
num_tokens (the kept tokens, so callers can aggregate stats over rows weighted by it) and
nonfinite_tokens.

Non-finite rule (one for every loss): a token whose policy logprob, behavior logprob or
advantage is NaN or ±inf is dropped from the loss and counted in `nonfinite_tokens`: it is
replaced by zeros BEFORE any exp or product (so no `0 * inf` or `exp(inf)` NaN reaches the loss
or the gradient), contributes 0 to the loss, gets a zero gradient and is left out of the ratio
statistics; N is not changed (it is fixed before the forward, C07; the trainer already takes
tokens with a non-finite recorded logprob or advantage out of N, `Trainer.pack`). Finite but
extreme logprobs are safe too: the log-ratio is clamped to ±LOG_RATIO_BOUND before exp, so
no ratio overflows (beyond the bound a ratio carries no gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LOG_RATIO_BOUND = 20.0
"""|log r| is clamped to this before exp (r <= 4.9e8), as verl bounds its log-ratios."""


def _ratio_stats(ratio: Tensor, clipped: Tensor, keep: Tensor) -> dict[str, float]:
    """Ratio statistics over the kept tokens (`keep`, bool (K,))."""
    k, dropped = int(keep.sum()), float((~keep).sum())
    if k == 0:
        return {"ratio_mean": 0.0, "ratio_max": 0.0, "clip_frac": 0.0, "num_tokens": 0.0,
                "nonfinite_tokens": dropped}
    return {
        "ratio_mean": ratio[keep].mean().item(),
        "ratio_max": ratio[keep].max().item(),
        "clip_frac": clipped[keep].float().mean().item(),
        "num_tokens": float(k),
        "nonfinite_tokens": dropped,
    }


def _finite(policy: Tensor, behavior: Tensor, advantages: Tensor
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(policy, behavior, advantages with dropped tokens zeroed, log-ratio clamped to
    ±LOG_RATIO_BOUND, keep): the module's non-finite rule, applied before any exp."""
    keep = (policy.detach().isfinite() & behavior.isfinite() & advantages.isfinite())
    zero = torch.zeros((), dtype=policy.dtype, device=policy.device)
    policy = torch.where(keep, policy, zero)  # gradient 0 (never NaN) at dropped tokens
    behavior = torch.where(keep, behavior.detach(), zero)
    advantages = torch.where(keep, advantages.detach(), zero)
    log_ratio = (policy - behavior).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return policy, behavior, advantages, log_ratio, keep


def _check(policy: Tensor, behavior: Tensor, advantages: Tensor, num_loss_tokens: int) -> None:
    if not (policy.shape == behavior.shape == advantages.shape) or policy.dim() != 1:
        raise ValueError(
            f"expected equal 1-D shapes, got policy {tuple(policy.shape)}, behavior "
            f"{tuple(behavior.shape)}, advantages {tuple(advantages.shape)}"
        )
    if num_loss_tokens <= 0:
        raise ValueError(f"num_loss_tokens must be positive, got {num_loss_tokens}")


LossFn = Callable[[Tensor, Tensor, Tensor, int], tuple[Tensor, dict[str, float]]]
"""(policy_logprobs (K,), behavior_logprobs (K,), advantages (K,), num_loss_tokens) -> (loss,
stats); the trainer's loss interface, built from the config's `trainer.loss` union."""


def cispo_loss(
    policy_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    num_loss_tokens: int,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO loss (MiniMax-M1, arXiv 2506.13585 eq. 4; Forge §4.1).

    J = 1/N · Σ_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) · Â_t · log π_θ(o_t); loss = -J.

    The clipped ratio is a stop-gradient importance weight, so every token keeps a gradient
    d loss / d policy_logprobs_t = -clip(r_t)·Â_t / N (unlike PPO, no token is dropped). With the
    default eps_low = 1 the lower bound is 0, i.e. DESIGN.md's clip(r, 0, 1 + ε_high).
    No deviation from the paper except the delta convention for the bounds.
    """
    _check(policy_logprobs, behavior_logprobs, advantages, num_loss_tokens)
    policy, _, adv, log_ratio, keep = _finite(policy_logprobs, behavior_logprobs, advantages)
    ratio = torch.exp(log_ratio).detach()  # (K,)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -(weight * adv * policy).sum() / num_loss_tokens
    return loss, _ratio_stats(ratio, weight != ratio, keep)


def ppo_clip_loss(
    policy_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    num_loss_tokens: int,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip surrogate (Schulman et al. 2017 eq. 7) with the behavior policy as π_old.

    J = 1/N · Σ_t min(r_t·Â_t, clip(r_t, 1 - eps_low, 1 + eps_high)·Â_t); loss = -J.
    Here the ratio carries the gradient, and tokens whose clipped term is the minimum get none.
    For comparison with CISPO (same signature; defaults follow DAPO's clip-higher 0.2 / 0.28).
    """
    _check(policy_logprobs, behavior_logprobs, advantages, num_loss_tokens)
    _, _, adv, log_ratio, keep = _finite(policy_logprobs, behavior_logprobs, advantages)
    ratio = torch.exp(log_ratio)  # (K,)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    loss = -surrogate.sum() / num_loss_tokens
    r = ratio.detach()
    return loss, _ratio_stats(r, (clipped.detach() * adv) < (r * adv), keep)


def tis_loss(
    policy_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    num_loss_tokens: int,
    tis_cap: float | None = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE with (truncated) importance sampling from the behavior policy.

    J = 1/N · Σ_t sg(w_t) · Â_t · log π_θ(o_t) with w_t = min(r_t, tis_cap) (TIS: Yao et al.
    2025, "Your efficient RL framework secretly brings you off-policy RL training"), or w_t = r_t
    when tis_cap is None (plain IS, unbounded variance). It equals `cispo_loss` with
    eps_low = 1, eps_high = tis_cap - 1, and is computed by it; kept as the named baseline.
    """
    eps_high = float("inf") if tis_cap is None else tis_cap - 1.0
    return cispo_loss(policy_logprobs, behavior_logprobs, advantages, num_loss_tokens,
                      eps_low=1.0, eps_high=eps_high)


def nll_loss(
    policy_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    num_loss_tokens: int,
) -> tuple[Tensor, dict[str, float]]:
    """Supervised fine-tuning: token-mean negative log-likelihood, -1/N · Σ_t log π_θ(o_t).

    Used by the warm start on demonstrations (`controller.warmstart`); behavior logprobs and
    advantages are ignored (same signature as the RL losses, so the trainer's row loop serves
    both). Ratio statistics are reported as 1 (no importance weight).
    """
    _check(policy_logprobs, behavior_logprobs, advantages, num_loss_tokens)
    policy, _, _, _, keep = _finite(policy_logprobs, torch.zeros_like(behavior_logprobs),
                                    torch.zeros_like(advantages))
    ones = torch.ones_like(policy.detach())
    return -policy.sum() / num_loss_tokens, _ratio_stats(ones, ones != ones, keep)
