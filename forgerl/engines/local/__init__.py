"""The local rollout engine: a transformers causal LM behind a continuous-batching decode loop.

Modules: `engine` (LocalEngine: public API, checks, worker thread), `batcher` (the decode step:
continuous batching, prefill waves), `kv_batch` (running rows and their KV cache),
`prefix_cache` (KV reuse), `sampler` (sampling and logprobs), `kernels` (packed linears, decode
SDPA), `routes` (a MoE model's routed experts), `speculative` (drafts from an MTP head verified
in one forward, exact); the thread ↔ asyncio shell is forgerl/engines/worker.py, shared with the
vLLM engine.

Data flow: the gateway iterates `LocalEngine.stream(prompt_ids, params)` (or awaits `generate`,
which is the same stream's last item); the request joins a queue; one background worker thread
(torch releases the GIL) runs the decode loop and hands each sampled token, then the finished
completion, to the caller's asyncio queue through `loop.call_soon_threadsafe`, so a token
reaches the consumer one event-loop wake-up after it is sampled. Each loop step

1. applies a pending weight update (between decode steps) and re-prefills the running rows,
   so every later token is produced by the new weights over a KV cache built by them;
2. decodes one token for every running row (one forward over the left-padded KV cache), or,
   with a drafter and `speculative_tokens` k, drafts k tokens per row and verifies them in one
   forward of k + 1 tokens (`speculative.py`: 1 to k + 1 tokens per row);
3. admits newcomers (up to `max_batch_size` rows), prefills them as one left-padded batch and
   merges their KV cache into the running one (continuous batching);
4. records token, logprob and weight_version per row and streams it; finished rows, and rows
   whose consumer went away (cancelled), leave at once.

Prefix caching (KV reuse): after each prefill, and when a row finishes, the row's KV (prompt +
completion so far, unpadded) is kept in an LRU `PrefixCache` keyed by its token ids. A newcomer
takes the KV of the longest common token prefix from the cache and prefills only the rest, with
position ids continuing from the reused length (agent prompts share a long system prompt, and
turn k + 1 extends turn k's prompt + completion). Newcomers that share a prefix with each other
(a group of G rollouts) are prefilled in waves: the first computes the shared part, the others
reuse it. A weight update clears the cache, so every KV the engine attends over was built by the
current weights. With a `kv_pool` (forgerl/engines/kv_pool.py, shared by instances), the same
KV is also published there in BLOCK-token blocks, and a prefill whose cache hit is shorter than
the pooled prefix fetches that instead (`ContinuousBatcher._lookup`).

Padding is on the left (a prefill reusing cached KV lays out [pad, reused KV, pad, new tokens]);
an explicit 2D attention mask and per-row position ids make a batched row compute the same
logits as the row alone (up to float rounding). Only full-attention decoders (Llama family,
Mixtral-style MoE: `routes` records their routed experts) are supported (no sliding window).

Recorded logprobs are those of the distribution actually sampled (`sampler.py`, vLLM's order:
penalties, temperature, min_p, top_k, top_p; greedy: T = 1), log_softmax(logits / T) when every
parameter is neutral (CASES.md C04, C21).
"""

from forgerl.engines.local.engine import LocalEngine

__all__ = ["LocalEngine"]
