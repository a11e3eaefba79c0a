"""Fixtures shared by every test folder: the real SmolLM2 model file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2_GGUF = Path(__file__).parent.parent / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as Q4_1 GGUF, fetched by `make test` (scripts/fetch_model.py)."""
    path = Path(os.environ.get("PAGEGATE_SMOLLM2_GGUF", SMOLLM2_GGUF))
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make test` or `python scripts/fetch_model.py`")
    return path
