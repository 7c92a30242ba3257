"""Token sampling for the local engine: the behavior policy's logprobs and one draw per row.

Data flow: each forward's last-position logits (B, V) go through `sample_tokens` with each
row's `SamplingParams` and context (prompt ids, completion ids so far); the sampled ids feed the
next step and are recorded with their logprobs (`LocalEngine._sample`). The distribution is
vLLM's: penalties, temperature, min_p, top_k, top_p, in that order, and the recorded logprob is
its own, renormalised over the tokens kept (CASES.md C04, C21); with neutral params it is
log_softmax(logits / T), at the cost of one division and one log_softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forgerl.types import SamplingParams

Context = tuple[Sequence[int], Sequence[int]]  # a row's (prompt ids, completion ids so far)


def _penalise(x: torch.Tensor, params: Sequence[SamplingParams],
              contexts: Sequence[Context] | None) -> torch.Tensor:
    """A copy of `x` with vLLM's penalties (`SamplingParams`) on the rows that set one; `x`
    itself when none does. Raises ValueError when they do and `contexts` is None."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty]
    if rows and contexts is None:
        raise ValueError("a penalty needs each row's context (prompt and completion ids)")
    if not rows:
        return x
    counts = x.new_zeros(len(rows), x.shape[1])  # (S, V) occurrences in the completion
    seen = torch.zeros_like(counts, dtype=torch.bool)  # (S, V) in the prompt or the completion
    for j, i in enumerate(rows):
        prompt, done = (torch.tensor(list(ids), dtype=torch.long, device=x.device)
                        for ids in contexts[i])
        seen[j, prompt] = True
        counts[j].index_add_(0, done, x.new_ones(len(done)))
    rep, freq, pres = torch.tensor([[params[i].repetition_penalty, params[i].frequency_penalty,
                                     params[i].presence_penalty] for i in rows],
                                   device=x.device).T.unsqueeze(-1)  # each (S, 1)
    x, idx = x.clone(), torch.tensor(rows, device=x.device)
    sub, penalty = x[idx], torch.where(seen | (counts > 0), rep, 1.0)
    x[idx] = sub * torch.where(sub > 0, 1 / penalty, penalty) - freq * counts - pres * (counts > 0)
    return x


def _filter(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """min_p, top_k, top_p in place on the tempered logits of sampled rows that set one, with
    vLLM's ties (every token tied with the k-th stays; the top token always stays): -inf."""
    vocab = x.shape[1]
    rows = [i for i, p in enumerate(params)
            if p.temperature > 0 and (p.min_p > 0 or 0 < p.top_k < vocab or p.top_p < 1)]
    if not rows:
        return
    idx, dev = torch.tensor(rows, device=x.device), x.device
    sub, probs = x[idx], x[idx].softmax(dim=-1)
    min_p = torch.tensor([params[i].min_p for i in rows], device=dev).unsqueeze(-1)
    sub.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), -torch.inf)
    ascending, order = sub.sort(dim=-1)
    first = [vocab - params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in rows]
    kth = ascending.gather(1, torch.tensor(first, device=dev).unsqueeze(-1))
    ascending.masked_fill_(ascending < kth, -torch.inf)
    top_p = torch.tensor([params[i].top_p for i in rows], device=dev).unsqueeze(-1)
    below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # mass up to each token
    below[:, -1] = False
    x[idx] = sub.scatter(1, order, ascending.masked_fill(below & (top_p < 1), -torch.inf))


def sampling_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                      contexts: Sequence[Context] | None = None) -> torch.Tensor:
    """Log-probabilities (B, V) float32 of the distribution each row samples from, -inf on the
    tokens a filter dropped (module docstring). logits: (B, V). params: one per row; greedy
    rows (T = 0) use T = 1 and no filter. contexts: per row, needed when a row sets a penalty.
    Examples: logits [2, 1, 0] at T = 0.5 → token 0 -0.142932 (CASES.md C04); [2, 1, 0, -1]
    with tokens 0 and 3 in the context and repetition_penalty 1.1 → [-0.505362, -1.323544,
    -2.323544, -3.423544], where the penalty off gives log_softmax [-0.440190, ...] (C21)."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         dtype=torch.float32, device=logits.device)
    x = _penalise(logits.float(), params, contexts) / temps.unsqueeze(-1)  # a new tensor
    _filter(x, params)
    return torch.log_softmax(x, dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    contexts: Sequence[Context] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return (token ids (B,) int64, their logprobs (B,) float32).

    Row i is greedy (argmax) when params[i].temperature == 0, else a draw from the distribution
    of `sampling_logprobs` by inverse CDF: one uniform u from generators[i] (None: torch's
    global generator), the first token whose cumulative probability exceeds u · total (a
    zero-probability token, dropped by a filter or not, is never drawn), for all rows in one
    batched cumsum + searchsorted. The logprob is `sampling_logprobs(...)[i, token]`.
    """
    logp = sampling_logprobs(logits, params, contexts)  # (B, V)
    tokens = draw(logp, params, generators)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def draw(logp: torch.Tensor, params: Sequence[SamplingParams],
         generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Token ids (B,) int64 from log-probabilities (B, V) (unnormalised allowed): argmax for
    greedy rows, else the inverse-CDF draw of `sample_tokens`."""
    tokens = logp.argmax(dim=-1)  # (B,)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        cdf = logp[drawn].exp().cumsum(dim=-1)  # (S, V)
        u = torch.cat([torch.rand(1, generator=generators[i], device=logp.device)
                       for i in drawn])  # (S,)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)
        tokens[drawn] = pick.squeeze(-1).clamp(max=logp.shape[-1] - 1)
    return tokens
