"""Kernel tests: without a GPU, the Triton kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET,
set in tests/conftest.py)."""


import pytest


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    """Tests choose backends explicitly; a PAGEGATE_KERNEL_BACKEND in the shell must not leak in."""
    monkeypatch.delenv("PAGEGATE_KERNEL_BACKEND", raising=False)
