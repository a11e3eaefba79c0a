"""Several models behind one server: each served model is a slot with its own engine core (or data-parallel cores),
loaded on demand, unloaded least recently used first under --models-max, put to sleep when idle, and marked failed
alone when its core dies. This module holds what a slot is and how the models and their page budgets are found;
EngineHost (engine_host.py) drives them.

NOTE: one page budget, split by a fixed rule. --kv-cache-memory (on CPU its default) is the whole server's: each
loaded model gets `budget / capacity` of it when its core starts, where capacity is --models-max (or the number of
models), so the models loaded at once never hold more than the budget together. An unloaded or sleeping model's
share goes back and is what the next model to load or wake takes. A core's pool is sized when it starts, so a
share does not grow while its model runs: the split moves at loads and wakes, not per request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from pagegate.config import EngineConfig, parse_bytes
from pagegate.engine.serving.engine_client import EngineClient
from pagegate.gateway.prepare import ModelContext
from pagegate.gateway.settings import ServedModel

LOADED, LOADING, SLEEPING, UNLOADED, FAILED = "loaded", "loading", "sleeping", "unloaded", "failed"


class ModelSlot:
    """One served model: its names, its engine config, its state and, while loaded or sleeping, its engine."""

    def __init__(self, names: tuple[str, ...], engine_config: EngineConfig) -> None:
        self.names = names  # empty for a lone model named by its engine (the served name is learnt at load)
        self.engine_config = engine_config
        self.state = UNLOADED
        self.reason = "not loaded yet"
        self.engine: EngineClient | None = None
        self.model: ModelContext | None = None
        self.embedding_size: int | None = None  # the model's embedding size, from the warm-up (if it embeds)
        self.in_flight = 0  # API requests addressed to it being served: it is never unloaded while any are
        self.last_used = 0.0  # time.monotonic() of its last request: the least recently used is unloaded first
        self.loading: asyncio.Task[None] | None = None  # its load or wake, while one runs
        self.loads = 0  # how many times its core was started

    @property
    def name(self) -> str:
        if self.names:
            return self.names[0]
        return self.engine.model_name if self.engine is not None else "?"

    @property
    def holds_memory(self) -> bool:
        """Loaded or sleeping: its weights are in memory (it counts against --models-max)."""
        return self.engine is not None

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.loading is None

    def used(self) -> None:
        self.last_used = time.monotonic()

    def card_state(self) -> dict[str, str | None]:
        """Its /v1/models fields: the state, and why it failed (None unless it did)."""
        return {"state": self.state, "reason": self.reason if self.state == FAILED else None}


def discover_models(folder: str) -> list[ServedModel]:
    """--models-dir: every GGUF file and every folder with a config.json in it, named by its file or folder name
    (a GGUF's without its extension), in name order."""
    root = Path(folder)
    if not root.is_dir():
        raise SystemExit(f"--models-dir: {folder} is not a folder")
    found = [ServedModel(entry.stem, str(entry)) for entry in root.iterdir()
             if entry.is_file() and entry.suffix.lower() == ".gguf"]
    found += [ServedModel(entry.name, str(entry)) for entry in root.iterdir()
              if entry.is_dir() and (entry / "config.json").is_file()]
    if not found:
        raise SystemExit(f"--models-dir: {folder} holds no *.gguf file and no folder with a config.json")
    return sorted(found, key=lambda model: model.name)


def share_config(engine_config: EngineConfig, capacity: int) -> EngineConfig:
    """A model's EngineConfig with its share of the server's KV budget (an explicit --num-kv-blocks stays as it
    is: each model then gets that many pages)."""
    cache = engine_config.cache
    if cache.num_kv_blocks is not None or capacity <= 1:
        return engine_config
    budget = parse_bytes(cache.kv_cache_memory or cache.default_cpu_kv_cache_memory)
    return replace(engine_config, cache=replace(cache, kv_cache_memory=str(budget // capacity)))
