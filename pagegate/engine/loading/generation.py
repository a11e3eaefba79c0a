"""A model's generation defaults (generation_config.json, or a GGUF's eos ids)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationDefaults:
    """The folder's generation_config.json: eos ids and default sampling values (None: not set)."""

    eos_token_ids: list[int] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def sampling_overrides(self) -> dict[str, float]:
        """The sampling values the folder sets, as SamplingParams keyword arguments."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}
