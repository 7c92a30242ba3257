"""Token sampling for the local engine: the behavior policy's logprobs and one draw per row.

Data flow: each decode or prefill forward's last-position logits (B, V) go through
`sample_tokens`; the sampled ids feed the next step and the ids with their logprobs are recorded
on the rows (`LocalEngine._sample`). Recorded logprobs are those of the distribution actually
sampled, log_softmax(logits / T) (greedy: T = 1), over the full vocabulary (CASES.md C04).
"""

from __future__ import annotations

import torch


def sampling_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the distribution each row samples from: log_softmax(logits / T).

    logits: (B, V) float. temperatures: (B,) float, >= 0; rows with T == 0 (greedy) use T = 1.
    Returns (B, V) float32. Example (CASES.md C04): logits [2, 1, 0], T = 0.5 → token 0 gets
    -0.142932.
    """
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    return torch.log_softmax(logits.float() / t.float().unsqueeze(-1), dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    temperatures: list[float],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return (token ids (B,) int64, their logprobs (B,) float32).

    Row i is greedy (argmax) when temperatures[i] == 0, else a draw from softmax(logits / T)
    by inverse CDF: one uniform u from generators[i] (None: torch's global generator), the
    first token whose cumulative probability exceeds u · total (a zero-probability token is
    never drawn), for all rows in one batched cumsum + searchsorted. The logprob is
    `sampling_logprobs(logits, T)[i, token]`, the behavior policy's logprob of that token.
    """
    temps = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
    logp = sampling_logprobs(logits, temps)  # (B, V)
    tokens = logp.argmax(dim=-1)  # (B,)
    drawn = [i for i, t in enumerate(temperatures) if t > 0]
    if drawn:
        cdf = logp[drawn].exp().cumsum(dim=-1)  # (S, V)
        u = torch.cat([torch.rand(1, generator=generators[i], device=logits.device)
                       for i in drawn])  # (S,)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)
        tokens[drawn] = pick.squeeze(-1).clamp(max=logp.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
