"""The rollout-engine contract: token ids in, token ids + behavior logprobs out.

The gateway tokenises; engines never see text. `local` (transformers) is the embedded default
and the test engine; vLLM / SGLang adapters implement the same protocol. `generate` returns a
whole completion; `stream` yields it token by token as the engine samples it (same tokens, same
record), so the gateway can forward deltas while decoding goes on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from forgerl.types import GenerateOutput, SamplingParams


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One sampled token of a streamed completion.

    token_id: the sampled id. logprob: its behavior-policy logprob (nats), from the distribution
    actually sampled. weight_version: the version of the weights that produced it.
    sampled_at: `time.perf_counter()` (seconds, this process's clock) when the engine sampled it,
    to measure sampling → client latency.
    """

    token_id: int
    logprob: float
    weight_version: int
    sampled_at: float


class RolloutEngine(Protocol):
    """A batched generator with versioned weights.

    weight_version: the version new requests are stamped with (starts at 0).
    max_model_len: context length in tokens (prompt + completion).
    """

    weight_version: int
    max_model_len: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """Generate one completion. Concurrent calls are batched by the engine.

        Equal to the last item of `stream(prompt_ids, params)`. Cancelling the awaiting task
        aborts the request. Raises ValueError when len(prompt_ids) + params.max_tokens >
        max_model_len.
        """
        ...

    def stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """Generate one completion as an async iterator (an async generator function).

        Yields one TokenEvent per sampled token, in order, then exactly one GenerateOutput, the
        whole completion, and stops. The GenerateOutput is what `generate` returns for the same
        request, and its completion_ids / logprobs / weight_versions are the TokenEvents'
        fields concatenated. Its finish_reason is "stop", "length", or "abort" (the engine
        closed; the output holds the tokens sampled so far, possibly none).

        Closing the iterator early (`aclose()`, leaving an `async with contextlib.aclosing(...)`
        block) or cancelling the task awaiting it aborts the request: the engine frees its batch
        slot at its next decode step, and no GenerateOutput is delivered. The consumer then
        holds a partial completion, which it must treat (and record) as aborted.

        Raises, from the first `__anext__`, what `generate` raises for a bad request, and an
        engine error (a failed forward) from the `__anext__` that meets it.
        """
        ...

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new policy weights between decode steps and publish `version`.

        In-flight requests continue with the new weights (partial rollouts); each token records
        the version that produced it. On failure the old weights and version stay.
        """
        ...

    async def close(self) -> None:
        """Stop the engine's background work; idempotent."""
        ...
