"""The runner an engine gets for its task: the native core's (a GGUF model on a CPU, every step in C, no torch in
the process), the decoder's (generation, optionally pooled embeddings) or the sentence encoder's (`--task embed`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagegate.config import EngineConfig
from pagegate.engine.loading import read_ahead
from pagegate.engine.native_runner import NativeRunner, NotNative, runs_native

if TYPE_CHECKING:
    from pagegate.engine.encoder_runner import EncoderRunner
    from pagegate.engine.runner import ModelRunner

log = logging.getLogger(__name__)

TASKS = ("generate", "embed")


def make_runner(config: EngineConfig, elastic: bool = False) -> NativeRunner | ModelRunner | EncoderRunner:
    """`elastic`: the runner's pages are a share of a budget several models hold (the torch runner's)."""
    if config.task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {config.task!r}")
    if runs_native(config, elastic):
        try:
            return NativeRunner(config)
        except NotNative as reason:
            log.info("the native core does not run this model (%s): the torch runner does", reason)
    read_ahead.drop()  # a model read ahead for the native core that will not serve it
    if config.task == "embed":
        from pagegate.engine.encoder_runner import EncoderRunner
        return EncoderRunner(config)
    from pagegate.engine.runner import ModelRunner
    return ModelRunner(config)
