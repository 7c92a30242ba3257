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
ratio_mean, ratio_max, clip_frac (fraction of the K tokens whose weight was clipped), and
num_tokens (K), so callers can aggregate stats over rows weighted by num_tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _ratio_stats(ratio: Tensor, clipped: Tensor) -> dict[str, float]:
    k = ratio.numel()
    if k == 0:
        return {"ratio_mean": 0.0, "ratio_max": 0.0, "clip_frac": 0.0, "num_tokens": 0.0}
    return {
        "ratio_mean": ratio.mean().item(),
        "ratio_max": ratio.max().item(),
        "clip_frac": clipped.float().mean().item(),
        "num_tokens": float(k),
    }


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
    ratio = torch.exp(policy_logprobs - behavior_logprobs).detach()  # (K,)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -(weight * advantages.detach() * policy_logprobs).sum() / num_loss_tokens
    return loss, _ratio_stats(ratio, weight != ratio)


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
    ratio = torch.exp(policy_logprobs - behavior_logprobs.detach())  # (K,)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    adv = advantages.detach()
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    loss = -surrogate.sum() / num_loss_tokens
    r = ratio.detach()
    return loss, _ratio_stats(r, (clipped.detach() * adv) < (r * adv))


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
    ones = torch.ones_like(policy_logprobs.detach())
    return -policy_logprobs.sum() / num_loss_tokens, _ratio_stats(ones, ones != ones)
