"""The runner an engine gets for its task: the decoder's (generation, optionally pooled embeddings) or the
sentence encoder's (`--task embed`)."""

from __future__ import annotations

from pagegate.config import EngineConfig
from pagegate.engine.encoder_runner import EncoderRunner
from pagegate.engine.runner import ModelRunner

TASKS = ("generate", "embed")


def make_runner(config: EngineConfig) -> ModelRunner | EncoderRunner:
    if config.task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {config.task!r}")
    return EncoderRunner(config) if config.task == "embed" else ModelRunner(config)
