"""Token sampling for the local engine: the behavior policy's logprobs and one draw per row.

Data flow: each decode or prefill forward's last-position logits (B, V) go through
`sample_tokens` with each row's `SamplingParams` and context (prompt ids, completion ids so
far); the sampled ids feed the next step and the ids with their logprobs are recorded on the
rows (`LocalEngine._sample`). The distribution sampled is vLLM's (`SamplingParams`):
penalties, temperature, min_p, top_k, top_p, in that order; the recorded logprob is that of
this distribution, renormalised over the tokens kept (CASES.md C04, C21). Rows whose params
are all neutral cost one division and one log_softmax: log_softmax(logits / T).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forgerl.types import SamplingParams

Context = tuple[Sequence[int], Sequence[int]]
"""One row's (prompt ids, completion ids sampled so far): what the penalties count."""


def _penalise(x: torch.Tensor, params: Sequence[SamplingParams],
              contexts: Sequence[Context] | None) -> torch.Tensor:
    """`x` with vLLM's penalties on the rows that set one (a copy; `x` itself when none does):
    a token in the prompt or the completion is scaled by 1 / repetition_penalty (logit > 0) or
    by it (logit <= 0); then frequency_penalty times its count in the completion and
    presence_penalty once if it is there are subtracted."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0
            or p.presence_penalty or p.frequency_penalty]
    if not rows:
        return x
    if contexts is None:
        raise ValueError("a penalty needs each row's context (prompt and completion ids)")
    counts = x.new_zeros(len(rows), x.shape[1])  # (S, V) occurrences in the completion
    in_prompt = torch.zeros_like(counts, dtype=torch.bool)
    for j, i in enumerate(rows):
        prompt, done = contexts[i]
        in_prompt[j, torch.tensor(list(prompt), dtype=torch.long, device=x.device)] = True
        out = torch.tensor(list(done), dtype=torch.long, device=x.device)
        counts[j].index_add_(0, out, torch.ones_like(out, dtype=x.dtype))
    x, idx = x.clone(), torch.tensor(rows, device=x.device)
    col = [[params[i].repetition_penalty, params[i].frequency_penalty,
            params[i].presence_penalty] for i in rows]
    rep, freq, pres = torch.tensor(col, dtype=x.dtype, device=x.device).T.unsqueeze(-1)
    sub = x[idx]
    penalty = torch.where(in_prompt | (counts > 0), rep, torch.ones_like(rep))
    sub *= torch.where(sub > 0, 1.0 / penalty, penalty)
    x[idx] = sub - freq * counts - pres * (counts > 0)
    return x


def _filter(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """min_p, top_k, top_p in place (vLLM's order and ties), on sampled rows that set one:
    dropped tokens get -inf. x holds the tempered logits."""
    vocab = x.shape[1]
    rows = [i for i, p in enumerate(params) if p.temperature > 0 and (
        p.min_p > 0 or 0 < p.top_k < vocab or p.top_p < 1)]
    if not rows:
        return
    idx = torch.tensor(rows, device=x.device)
    sub = x[idx]
    min_p = torch.tensor([params[i].min_p for i in rows], device=x.device).unsqueeze(-1)
    probs = sub.softmax(dim=-1)
    sub.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), -torch.inf)
    top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
    top_p = torch.tensor([params[i].top_p for i in rows], device=x.device).unsqueeze(-1)
    ascending, order = sub.sort(dim=-1)
    kth = ascending.gather(1, torch.tensor(top_k, device=x.device).neg().add(vocab)[:, None])
    ascending.masked_fill_(ascending < kth, -torch.inf)  # every token tied with the k-th stays
    below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # mass at or under each token
    below[:, -1] = False  # the top token always stays
    ascending.masked_fill_(below & (top_p < 1), -torch.inf)
    x[idx] = sub.scatter(1, order, ascending)


def sampling_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                      contexts: Sequence[Context] | None = None) -> torch.Tensor:
    """Log-probabilities of the distribution each row samples from (module docstring).

    logits: (B, V) float. params: B `SamplingParams`; rows with temperature 0 (greedy) use
    T = 1 and no filter. contexts: each row's (prompt ids, completion ids so far), needed only
    when a row sets a penalty (ValueError without them). Returns (B, V) float32, -inf on dropped
    tokens. Examples: logits [2, 1, 0], T = 0.5 → token 0 gets -0.142932 (CASES.md C04);
    logits [2, 1, 0, -1] with tokens 0 and 3 in the context and repetition_penalty 1.1 →
    [-0.505362, -1.323544, -2.323544, -3.423544] (C21), against log_softmax [-0.440190,
    -1.440190, -2.440190, -3.440190] with the penalty off.
    """
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
    zero-probability token, one a filter dropped included, is never drawn), for all rows in one
    batched cumsum + searchsorted. The logprob is `sampling_logprobs(...)[i, token]`, the
    behavior policy's logprob of that token.
    """
    logp = sampling_logprobs(logits, params, contexts)  # (B, V)
    tokens = logp.argmax(dim=-1)  # (B,)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        cdf = logp[drawn].exp().cumsum(dim=-1)  # (S, V)
        u = torch.cat([torch.rand(1, generator=generators[i], device=logits.device)
                       for i in drawn])  # (S,)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)
        tokens[drawn] = pick.squeeze(-1).clamp(max=logp.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
