"""Prompt caching a client asks for, as prefix pins (engine/pins.py): OpenAI's `prompt_cache_key` pins a request's
prompt pages under that key, and each of Anthropic's `cache_control` breakpoints pins the prompt's pages up to the
marked block. A pin is taken once the prompt is computed and lives its TTL, refreshed by every hit of the same API
key, within --max-pinned-fraction of the pool, released first when a request needs pages.

NOTE: clients choose keys and breakpoints, so every pin's key is scoped here to the sending API key (and model,
adapter and cache salt) as a digest of a length-prefixed record, never a join: no client can name, refresh or
release another key's pin. A pin holds only pages of the request that took it, which under --prefix-cache-scope key
are rooted in its own key (core/chain_root.py): it never makes another key's pages live or visible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from pagegate.engine.pin import Pin

BREAKPOINT_TTL_S = {"5m": 300.0, "1h": 3600.0}  # Anthropic's cache_control ttl
RETENTION_TTL_S = {"in_memory": 300.0, "24h": 86400.0}  # OpenAI's prompt_cache_retention
DEFAULT_TTL_S = 300.0
ONE_HOUR_S = BREAKPOINT_TTL_S["1h"]


def key_pin(name: str, num_tokens: int, retention: str | None) -> Pin:
    """OpenAI's prompt_cache_key: the prompt's full pages under `name`, for a day with retention "24h", else 5 min."""
    return Pin("key\0" + name, RETENTION_TTL_S.get(retention or "", DEFAULT_TTL_S), num_tokens)


def prefix_pin(token_ids: Sequence[int], num_tokens: int, ttl: str) -> Pin:
    """An Anthropic breakpoint: the prompt's first `num_tokens` tokens, named by them, so that the same prefix sent
    again refreshes the same pin (and a longer one, a conversation's next turn, takes a pin of its own)."""
    digest = hashlib.sha256(array("q", token_ids[:num_tokens]).tobytes()).hexdigest()
    return Pin("prefix\0" + digest, BREAKPOINT_TTL_S[ttl], num_tokens)


def scoped(pin: Pin, tenant: str | None, model: str, cache_salt: str | None) -> Pin:
    """`pin` under a key only requests of the same API key, model (or adapter) and salt can name."""
    record = hashlib.sha256()
    for field in (tenant, model, cache_salt, pin.key):
        raw = b"" if field is None else field.encode()
        record.update(b"\x00" if field is None else b"\x01" + len(raw).to_bytes(8, "big") + raw)
    return Pin("cache:" + record.hexdigest(), pin.ttl_s, pin.num_tokens)


def cache_writes(pins: Sequence[Pin], pinned_tokens: Sequence[int], cache_read: int) -> tuple[int, int]:
    """Prompt tokens this request wrote into pinned pages, (5-minute, 1-hour) as Anthropic counts them: those up to
    its furthest pin that the prefix cache did not already hold, the part up to its furthest 1-hour pin counted as
    1-hour (breakpoints of longer TTL come first)."""
    held = list(zip(pins, pinned_tokens, strict=False))
    hour = max((tokens for pin, tokens in held if pin.ttl_s >= ONE_HOUR_S), default=0)
    furthest = max((tokens for _, tokens in held), default=0)
    return max(0, furthest - max(hour, cache_read)), max(0, hour - cache_read)
