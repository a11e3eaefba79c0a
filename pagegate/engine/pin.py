"""A prefix pin as a request asks for it (pins.py holds them in the engine): a plain value the gateway builds and
sends, importing nothing of the engine's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    """What a request asks for: keep pages under `key` for `ttl_s` seconds. With `num_tokens`, the full pages of its
    first `num_tokens` prompt tokens, taken once the prompt is computed (a breakpoint, a prompt_cache_key); without,
    every full page it wrote, prompt and answer, taken when it finishes (a stored conversation's turn)."""

    key: str
    ttl_s: float
    num_tokens: int | None = None
