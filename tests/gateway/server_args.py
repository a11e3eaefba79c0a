"""Flags of the test servers: the embedded model (or $PAGEGATE_TEST_MODEL), float32 on CPU, float32 pages by name
(the CPU's default is int8): prompt logprobs and pooled embeddings are held to transformers' float32 values."""

from __future__ import annotations

import os


def server_args(*extra: str) -> list[str]:
    model = os.environ.get("PAGEGATE_TEST_MODEL")
    base = ["--dtype", "float32", "--kv-cache-dtype", "float32", "--device", "cpu", "--disable-uvicorn-access-log",
            "--grpc-port", "0"]
    return (["--model", model] if model else []) + base + list(extra)
