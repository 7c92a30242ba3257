"""The MTP draft head for speculative decoding (DeepSeek-V3 multi-token prediction, one depth).

Data flow: the trainer builds a `Drafter` for its policy (`Drafter.for_model`), warms it up on
the policy's own forwards (`warm_start`) and trains it in each step with `drafter_loss` on the
hidden states of its prefix-tree forward (`trainer.Trainer`); weight sync sends its tensors
under the `drafter.` prefix (`PREFIX`), and the local engine drafts with its copy
(`engines.local.speculative`). Engines and trainer both import this module (models layer).

The head: h_t (the policy's final hidden state at position t, after its last norm, the one
whose logits give x_{t+1}) and e = embed(x_{t+1}) are RMS-normed each, concatenated, projected
to the hidden size, passed through one SwiGLU MLP block (residual) and a final RMSNorm; the
policy's own LM head (shared, never trained here) turns the result into logits for x_{t+2}.
Chained drafting feeds the head's output hidden back in place of h: draft j + 1 comes from
(g_j, embed(d_j)); `drafter_loss` trains depth 1 on the policy's hidden states and depth 2 on
the head's own output, the input chained drafting gives it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PREFIX = "drafter."
"""Name prefix of the drafter's tensors in a weight-sync state dict."""


class Drafter(nn.Module):
    """One MTP layer: (h (..., H), token embeddings (..., H)) → next hidden (..., H)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.norm_embed = nn.RMSNorm(hidden_size, eps=eps)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm_mlp = nn.RMSNorm(hidden_size, eps=eps)
        self.gate = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        self.up = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        self.down = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm_out = nn.RMSNorm(hidden_size, eps=eps)

    @classmethod
    def for_model(cls, model: nn.Module, seed: int = 0) -> Drafter:
        """A fresh head for `model` (a HF causal LM): its hidden size, its RMSNorm eps and the
        weights' dtype; `seed` fixes the random init."""
        config = model.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6))
        weight = model.get_input_embeddings().weight
        return head.to(weight.device, weight.dtype)

    def forward(self, hidden: Tensor, embeds: Tensor) -> Tensor:
        x = self.proj(torch.cat([self.norm_hidden(hidden), self.norm_embed(embeds)], dim=-1))
        y = self.norm_mlp(x)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self.norm_out(x)

    def draft(self, model: nn.Module, hidden: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(next hidden (B, H), logits (B, V)) from hidden (B, H) and the tokens (B,) that
        follow; the policy's embedding and LM head weights are read detached (never trained
        through the drafter); without autograd the LM head runs its own forward (an engine's
        oneDNN-packed one, `kernels.pack_linears`)."""
        embeds = F.embedding(tokens, model.get_input_embeddings().weight.detach())
        out = self(hidden.to(embeds.dtype), embeds)
        head = model.get_output_embeddings()  # without gradients: its own (maybe packed) forward
        if torch.is_grad_enabled():
            return out, F.linear(out, head.weight.detach())
        return out, head(out)


def topk_kl(draft_logits: Tensor, policy_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(KL (M,), top-1 agreement (M,) float) of the drafter to the policy's next-token
    distribution restricted to its top k tokens: Σ_{v ∈ topk(p)} p_v (log p_v - log q_v), p =
    softmax(policy_logits) (detached), q = softmax(draft_logits) over the whole vocabulary.
    Both logits (M, V)."""
    with torch.no_grad():
        logp = torch.log_softmax(policy_logits.float(), dim=-1)
        top_logp, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # (M, k)
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    kl = (top_logp.exp() * (top_logp - logq.gather(-1, top_ids))).sum(-1)
    return kl, (draft_logits.argmax(-1) == top_ids[:, 0]).float()


def drafter_loss(drafter: Drafter, model: nn.Module, hidden: Tensor, input_ids: Tensor,
                 parent: Tensor, positions: Tensor, k: int, target: Tensor | None = None
                 ) -> tuple[Tensor, dict[str, float]]:
    """The drafter's training loss on one forward's final hidden states (detached here).

    hidden: (N, H) the policy's final hidden states of a row of N tokens; input_ids (N,);
    parent (N,) the row index of each token's predecessor (-1 for a root; a plain sequence is
    arange(N) - 1, a prefix-tree row has its tree parents); positions (M,) the rows j whose
    policy distribution is a target. Depth 1: (h[parent j], embed(x_j)) → p_j; depth 2:
    (g[parent j], embed(x_j)) → p_j, g = the head's depth-1 output at parent j. Returns (mean
    top-k KL over both depths, {"drafter_kl": depth-1 mean KL, "drafter_top1": depth-1 top-1
    agreement, "drafter_positions": M}); a zero loss without positions. target: the policy's
    logits at every row (N, V), when already at hand (else computed from `hidden`)."""
    hidden = hidden.detach().to(drafter.proj.weight.dtype)
    j = positions[parent[positions] >= 0]
    if j.numel() == 0:
        return hidden.new_zeros(()), {}
    with torch.no_grad():
        target = (F.linear(hidden[j], model.get_output_embeddings().weight) if target is None
                  else target[j])  # (M, V)
    _, logits = drafter.draft(model, hidden[parent[j]], input_ids[j])
    kl, top1 = topk_kl(logits, target, k)
    loss, deep = kl.mean(), parent[parent[j]] >= 0
    if deep.any():  # depth 2 from the head's own output at the parent
        p = parent[j[deep]]
        g_parent, _ = drafter.draft(model, hidden[parent[p]], input_ids[p])
        _, logits2 = drafter.draft(model, g_parent, input_ids[j[deep]])
        loss = loss + topk_kl(logits2, target[deep], k)[0].mean()
    return loss, {"drafter_kl": kl.mean().item(), "drafter_top1": top1.mean().item(),
                  "drafter_positions": float(j.numel())}


def final_hidden(model: nn.Module, input_ids: Tensor) -> Tensor:
    """(B, S, H) final hidden states (after the last norm) of `model` on input_ids (B, S)."""
    return model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state


def warm_start(drafter: Drafter, model: nn.Module, sequences: list[list[int]], steps: int,
               lr: float = 3e-3, k: int = 16, batch: int | None = None) -> list[float]:
    """Distil `drafter` on `model`'s own forwards over `sequences` (e.g. the policy's samples)
    for `steps` AdamW steps, each over `batch` sequences taken in turn (default: all; their
    hidden states are computed once, without gradients); returns the depth-1 top-k KL of each
    step. The policy is not changed."""
    with torch.no_grad():
        states = [final_hidden(model, torch.tensor([s], device=drafter.proj.weight.device))[0]
                  for s in sequences]
        targets = [F.linear(h, model.get_output_embeddings().weight) for h in states]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    kls, size = [], min(batch or len(sequences), len(sequences))
    for step in range(steps):
        total = 0.0
        for i in range(step * size, (step + 1) * size):
            seq, hidden, target = (x[i % len(sequences)] for x in (sequences, states, targets))
            n = len(seq)
            ids = torch.tensor(seq, device=hidden.device)
            parent = torch.arange(n, device=hidden.device) - 1
            loss, stats = drafter_loss(drafter, model, hidden, ids, parent,
                                       torch.arange(n, device=hidden.device), k, target)
            (loss / size).backward()
            total += stats.get("drafter_kl", 0.0) / size
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        kls.append(total)
    return kls


@torch.no_grad()
def policy_samples(model: nn.Module, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` sequences of `length` tokens sampled (T = 1) from `model` itself, each after one
    random start token (seeded): the warm start's data when no prompts are at hand."""
    device = model.get_input_embeddings().weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(vocab, (n, 1), generator=gen, device=device)
    for _ in range(length - 1):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    return ids.tolist()
