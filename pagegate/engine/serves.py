"""What a runner's model answers (torch-free: the intake and the native core read it)."""

from __future__ import annotations

from dataclasses import dataclass

GENERATIVE_POOLING = ("last", "mean")  # --pooling: the last prompt token's hidden state, or the mean of all


@dataclass(frozen=True)
class Serves:
    """What a runner's model answers: generations, embeddings (pooled how; None: none), or both."""

    generate: bool = True
    pooling: str | None = None
