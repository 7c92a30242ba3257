"""Speculative decoding for the local engine: an MTP drafter proposes, the policy verifies.

Data flow: with a drafter and `speculative_tokens` k > 0, a decode step (`ContinuousBatcher.
_decode`) whose rows all carry their last final hidden state (`_Request.draft_hidden`, kept
by `note_hidden` after every forward) becomes `spec_decode`: the drafter (`forgerl.drafter`)
drafts k tokens per row, chained on its own output hidden, each drawn from q_j, the drafter's
logits through the row's own sampling transform (`sampler.sampling_logprobs` with the context
so far, drafts included); ONE policy forward over [pending, d_1..d_k] (k + 1 tokens per row)
gives p_0..p_k, the processed sampling distributions at each position (same transforms and
context). Per row, exact speculative rejection sampling (Leviathan et al. 2023, Alg. 1; Chen
et al. 2023): d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection a token is drawn from norm(max(0, p_j - q_j)) (p_j when that is all zero); when all
k pass a bonus token is drawn from p_k. Greedy rows (temperature 0) accept d_j iff it is the
argmax of p_j and take that argmax otherwise. Every emitted token is therefore distributed as
the policy's sampling distribution (every transform of the sampler is expressed exactly, so no
row falls back), and its recorded logprob is log p_j of the token (C04, C18).

KV: the forward appends k + 1 columns to each row; a row that emitted n tokens keeps the first
n of them (the pending token and its accepted drafts but the last emitted one, the new pending
token), the others are masked out in that row's attention mask, so later steps never attend to
rejected drafts; positions advance by n. `record` stops a row at a stop id or max_tokens in the
middle of a draft (the remaining drafts are dropped) and streams each emitted token at once.
Stats: "spec_steps", "draft_tokens" (k per row and step), "accepted_tokens" (drafts accepted;
acceptance rate = accepted / draft), "spec_tokens" (tokens emitted by speculative steps).
"""

from __future__ import annotations

import time

import torch

from forgerl.drafter import Drafter
from forgerl.engines.local.kv_batch import _Batch, _Request
from forgerl.engines.local.sampler import draw, sampling_logprobs
from forgerl.types import SamplingParams


class SpeculativeDecoder:
    """The speculative half of `ContinuousBatcher` (which sets the attributes below)."""

    model: torch.nn.Module
    drafter: Drafter | None = None
    speculative_tokens: int = 0
    weight_version: int
    stats: dict
    _hidden: torch.Tensor | None = None  # (B, S, H) of the last forward, set by a hook

    def watch_hidden(self) -> None:
        """Keep the decoder's final hidden states of every forward in `_hidden` (with a
        drafter only)."""
        def hook(_module: torch.nn.Module, _args: object, output: object) -> None:
            self._hidden = output.last_hidden_state  # type: ignore[attr-defined]
        self.model.get_decoder().register_forward_hook(hook)

    def note_hidden(self, rows: list[_Request]) -> None:
        """Give each row the final hidden state of its last position in the last forward."""
        if self.drafter is None or self._hidden is None:
            return
        last = self._hidden[:, -1].clone()
        for i, req in enumerate(rows):
            req.draft_hidden = last[i]

    def spec_ready(self, batch: _Batch) -> int:
        """Drafts to make this step (0: decode normally): k, capped by the tokens the rows may
        still emit, and 0 when a row has no hidden state yet (its KV came from the cache)."""
        if self.drafter is None or any(r.draft_hidden is None for r in batch.rows):
            return 0
        left = max(r.params.max_tokens - len(r.completion_ids) for r in batch.rows)
        return max(0, min(self.speculative_tokens, left - 1))

    def spec_decode(self, batch: _Batch, k: int) -> _Batch:
        """One speculative step of k drafts per row (module docstring); returns `batch`."""
        assert self.drafter is not None
        rows, b = batch.rows, len(batch.rows)
        params, gens = [r.params for r in rows], [r.generator for r in rows]
        hidden = torch.stack([r.draft_hidden for r in rows])  # (B, H)
        tokens, drafts, logq = batch.next_ids, [], []
        for _ in range(k):
            hidden, logits = self.drafter.draft(self.model, hidden, tokens)
            logq.append(sampling_logprobs(logits, params, _contexts(rows, drafts)))
            tokens = draw(logq[-1], params, gens)
            drafts.append(tokens)
        ids = torch.stack([batch.next_ids, *drafts], dim=1)  # (B, k + 1)
        width = batch.mask.shape[1]
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(b, k + 1)], dim=1)
        positions = batch.positions[:, None] + torch.arange(k + 1, device=ids.device)
        out = self.model(input_ids=ids, attention_mask=batch.mask, position_ids=positions,
                         cache=batch.cache, use_cache=True)
        logp = torch.stack([sampling_logprobs(out.logits[:, j], params,
                                              _contexts(rows, drafts[:j]))
                            for j in range(k + 1)], dim=1)  # p_0..p_k: (B, k + 1, V)
        draft_ids = torch.stack(drafts, dim=1)  # (B, k)
        tokens, logprobs, accepted = verify(logp, torch.stack(logq, dim=1), draft_ids, params,
                                            gens)
        verified, now, emitted = self._hidden, time.perf_counter(), []
        for i, (req, toks, lps, ok) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist(),
                                                     accepted.tolist(), strict=True)):
            n = 0
            while n <= ok and req.finish_reason is None:  # stop ids, max_tokens mid-draft
                req.record(toks[n], lps[n], self.weight_version, now)
                n += 1
            self.stats["accepted_tokens"] += min(ok, n)
            batch.mask[i, width + n:] = 0  # the KV of rejected (or unused) drafts
            req.draft_hidden = verified[i, n - 1].clone()
            emitted.append(n)
        time.sleep(0)  # release the GIL: the event loop delivers these tokens now
        batch.positions = batch.positions + torch.tensor(emitted, device=batch.positions.device)
        batch.next_ids = torch.tensor([r.completion_ids[-1] for r in rows],
                                      device=batch.next_ids.device)
        self.stats["spec_steps"] += 1
        self.stats["draft_tokens"] += k * b
        self.stats["spec_tokens"] += sum(emitted)
        return batch


def verify(logp: torch.Tensor, logq: torch.Tensor, drafts: torch.Tensor,
           params: list[SamplingParams], generators: list[torch.Generator | None]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (module docstring) for B rows of k drafts.

    logp: (B, k + 1, V) the policy's sampling log-probabilities p_0..p_k; logq: (B, k, V) the
    drafter's q_1..q_k the drafts were drawn from; drafts: (B, k) int64. Row i draws k uniforms
    and then one token from its generator (None: torch's global one); greedy rows none.
    Returns (tokens (B, k + 1), their log p (B, k + 1), accepted (B,)): row i emits tokens[i,
    :accepted[i] + 1], its accepted drafts then the resampled (or bonus) token."""
    b, k = drafts.shape
    greedy = torch.tensor([p.temperature == 0 for p in params], device=logp.device)
    u = torch.stack([torch.rand(k, generator=g, device=logp.device) if p.temperature > 0
                     else torch.zeros(k, device=logp.device) for p, g in zip(params, generators,
                                                                             strict=True)])
    p_x = logp[:, :k].gather(2, drafts[..., None]).squeeze(2).exp()  # (B, k)
    q_x = logq.gather(2, drafts[..., None]).squeeze(2).exp()
    ok = torch.where(greedy[:, None], logp[:, :k].argmax(-1) == drafts, u * q_x < p_x)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # drafts before the first rejection: (B,)
    rows = torch.arange(b, device=logp.device)
    p_at = logp[rows, accepted]  # (B, V) where the last token is drawn
    q_at = torch.cat([logq, torch.full_like(logq[:, :1], -torch.inf)], 1)[rows, accepted]
    residual = (p_at.exp() - q_at.exp()).clamp(min=0)  # p itself after k accepted drafts
    usable = (residual.sum(-1, keepdim=True) > 0) & ~greedy[:, None]
    last = draw(torch.where(usable, residual.log(), p_at), params, generators)  # (B,)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1)
    tokens[rows, accepted] = last
    return tokens, logp.gather(2, tokens[..., None]).squeeze(2), accepted


def _contexts(rows: list[_Request], drafts: list[torch.Tensor]) -> list[tuple[list[int],
                                                                               list[int]]]:
    """Each row's (prompt ids, completion ids + the drafts so far), for the penalties."""
    extra = torch.stack(drafts, dim=1).tolist() if drafts else [[] for _ in rows]
    return [(r.prompt_ids, r.completion_ids + e) for r, e in zip(rows, extra, strict=True)]
