"""A GGUF model read for the native core before its spec comes.

`pagegate serve`'s first core reads the file its arguments name while the gateway imports its app
(core_spawn.start_early_core), and before the core's own imports of its loop (core_process's NOTE): its tokenizer's
vocabulary goes to the gateway first (`on_vocab`), then the core builds its own tokenizer and repacks the weights. The
native runner built for that path takes what was read (`take`); any other runner drops it (`drop`). Light to import:
the file's reader, the tokenizer's builder and the repack, nothing of the engine's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagegate.engine.loading.gguf_file import GGUFFile
from pagegate.engine.loading.gguf_native import ARCHITECTURES, NativeModel, load_native
from pagegate.engine.loading.gguf_tokenizer import tokenizer_from_gguf, vocabulary
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.kernels.dispatch import default_threads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadAhead:
    gguf: GGUFFile
    tokenizer: Tokenizer
    weights: NativeModel


_read: dict[Path, ReadAhead] = {}  # by the file's resolved path


def read_ahead(path: str, on_vocab: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Read the GGUF model at `path` for the native core, where it is of a family the core computes. `on_vocab`:
    called with the file's vocabulary (gguf_tokenizer.vocabulary) before anything else is built from it."""
    try:
        gguf = GGUFFile(Path(path))
        if gguf.arch not in ARCHITECTURES:
            return
        if on_vocab is not None:
            on_vocab(vocabulary(gguf.metadata))
        tokenizer = tokenizer_from_gguf(gguf.metadata, lazy_merges=True)  # a server's core only decodes
        # a CPU fewer than a load's: the gateway imports on one meanwhile (on two, a second OpenMP thread repacked
        # SmolLM2 no sooner, and spun between the repacks on the gateway's CPU)
        _read[Path(path).resolve()] = ReadAhead(gguf, tokenizer, load_native(gguf, max(1, default_threads() - 1)))
    except Exception:  # noqa: BLE001 - a guess made early: the load the spec asks for reads it again and says why
        log.debug("the model %s was not read ahead", path, exc_info=True)


def take(path: Path) -> ReadAhead | None:
    """What was read of the file at `path` (any name of it), now the caller's; None where nothing was."""
    return _read.pop(path.resolve(), None)


def tokenizer_read(path: Path) -> Tokenizer | None:
    """The tokenizer of the file at `path` where it was read ahead (still there to take)."""
    read = _read.get(path.resolve())
    return read.tokenizer if read is not None else None


def drop() -> None:
    _read.clear()
