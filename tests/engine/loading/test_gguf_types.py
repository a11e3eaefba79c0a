"""pagegate's copy of the `gguf` package's tables (gguf_types.py) against the package's own."""

from __future__ import annotations

import gguf

from pagegate.engine.loading import gguf_types


def test_the_tables_are_the_gguf_packages() -> None:
    for ours, theirs in ((gguf_types.GGMLQuantizationType, gguf.GGMLQuantizationType),
                         (gguf_types.GGUFValueType, gguf.GGUFValueType)):
        assert [(kind.name, kind.value) for kind in ours] == [(kind.name, kind.value) for kind in theirs]
    assert {int(kind): size for kind, size in gguf_types.GGML_QUANT_SIZES.items()} == \
        {int(kind): size for kind, size in gguf.GGML_QUANT_SIZES.items()}
    assert (gguf_types.GGUF_MAGIC, gguf_types.GGUF_DEFAULT_ALIGNMENT) == (gguf.GGUF_MAGIC, gguf.GGUF_DEFAULT_ALIGNMENT)
