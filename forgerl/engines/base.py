"""The rollout-engine contract: token ids in, token ids + behavior logprobs out.

The gateway tokenises; engines never see text. `local` (transformers) is the embedded default
and the test engine; vLLM / SGLang adapters implement the same protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from forgerl.types import GenerateOutput, SamplingParams


class RolloutEngine(Protocol):
    """A batched generator with versioned weights.

    weight_version: the version new requests are stamped with (starts at 0).
    max_model_len: context length in tokens (prompt + completion).
    """

    weight_version: int
    max_model_len: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """Generate one completion. Concurrent calls are batched by the engine.

        Raises ValueError when len(prompt_ids) + params.max_tokens > max_model_len.
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
