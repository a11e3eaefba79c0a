"""Kernel tests: without a GPU, the Triton kernels run on the CPU through Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # triton.jit reads this when a kernel is decorated, so it must be set before
    # pagegate.kernels.triton_* is first imported; conftest runs before test modules import
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    """Tests choose backends explicitly; a PAGEGATE_KERNEL_BACKEND in the shell must not leak in."""
    monkeypatch.delenv("PAGEGATE_KERNEL_BACKEND", raising=False)
