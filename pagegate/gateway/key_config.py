"""--api-key-config FILE: API keys with a name, a weight and a quota of KV pages (fair pages per key).

The file is JSON (a list of entries, or {"keys": [...]}) or TOML ([[keys]] tables); each entry is
{name, key, weight = 1, max_kv_blocks = none}. Its keys open the API as --api-key ones do. The engine weighs each
request by its key's entry (pagegate.engine.tenants.KeyShare): among waiting requests of one lane and priority, the
key furthest below its weighted share of pages goes first, and its running requests hold at most max_kv_blocks
pages. Metrics show the entry's name, never its key. A key without an entry weighs 1 and has no quota."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomllib

from pagegate.engine.tenants import KeyShare
from pagegate.gateway.auth import key_identity
from pagegate.gateway.settings import ConfiguredKey

FIELDS = frozenset({"name", "key", "weight", "max_kv_blocks"})


def load_key_config(path: str | Path) -> list[ConfiguredKey]:
    """The entries of an --api-key-config file (TOML by its .toml suffix, else JSON); ValueError saying what is
    wrong, and where."""
    path = Path(path)
    text = path.read_text()
    try:
        raw: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: {error}") from None
    return parse_key_config(raw, str(path))


def parse_key_config(raw: Any, source: str = "--api-key-config") -> list[ConfiguredKey]:
    entries = raw.get("keys") if isinstance(raw, dict) else raw
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: expected a list of keys (JSON: a list or {{\"keys\": [...]}}; TOML: [[keys]])")
    configured = [_entry(item, f"{source}: entry {index}") for index, item in enumerate(entries)]
    for what, seen in (("name", [c.share.name for c in configured]), ("key", [c.key for c in configured])):
        if len(set(seen)) != len(seen):
            raise ValueError(f"{source}: two entries share a {what}; each must have its own")
    return configured


def _entry(item: Any, where: str) -> ConfiguredKey:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a table of {sorted(FIELDS)}")
    unknown = sorted(set(item) - FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(FIELDS)}")
    name, key = item.get("name"), item.get("key")
    if not isinstance(name, str) or not name or not isinstance(key, str) or not key:
        raise ValueError(f"{where}: `name` and `key` must be non-empty strings")
    weight, quota = item.get("weight", 1.0), item.get("max_kv_blocks")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"{where} ({name}): `weight` must be a number")
    if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int)):
        raise ValueError(f"{where} ({name}): `max_kv_blocks` must be a whole number of pages")
    try:
        return ConfiguredKey(key, KeyShare(name, float(weight), quota))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


class KeyShares:
    """Each key identity's share of the pages: its entry's, else weight 1 and no quota under the identity's name."""

    def __init__(self, configured: list[ConfiguredKey]) -> None:
        self._by_identity = {key_identity(entry.key): entry.share for entry in configured}

    def of(self, identity: str | None) -> KeyShare | None:
        """None for a request without a key (a server without keys)."""
        if identity is None:
            return None
        return self._by_identity.get(identity) or KeyShare(identity)
