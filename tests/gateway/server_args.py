"""Flags of the test servers: the embedded model (or $PAGEGATE_TEST_MODEL), float32 on CPU, float32 pages by name
(the CPU's default is int8): prompt logprobs and pooled embeddings are held to transformers' float32 values."""

from __future__ import annotations

import os


def server_args(*extra: str, embedded: bool = False) -> list[str]:
    """The flags, then `extra`; `embedded`: the embedded model whatever $PAGEGATE_TEST_MODEL says (for tests whose
    inputs, such as LoRA adapters, are shaped for it)."""
    model = None if embedded else os.environ.get("PAGEGATE_TEST_MODEL")
    base = ["--dtype", "float32", "--kv-cache-dtype", "float32", "--device", "cpu", "--disable-uvicorn-access-log",
            "--grpc-port", "0"]
    return (["--model", model] if model else []) + base + list(extra)
