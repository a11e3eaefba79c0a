"""Idefics3 image preprocessing against transformers' Idefics3Processor on the tiny SmolVLM: the same tiles, bit for
bit, and the same prompt token ids once our text replaces the `<image>` placeholder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from pagegate.engine.media.idefics3 import Idefics3Processing
from tests.engine.conftest import hf
from tests.engine.vision_models import LONGEST_EDGE, SEQ_LEN, TILE, save_smolvlm

SIZES = {"tiny": (20, 30), "odd": (77, 131), "wide": (90, 300), "tall": (300, 90), "tile": (128, 128),
         "large": (500, 700)}  # (height, width)
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                         {"type": "text", "text": "What is this?"}]}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny SmolVLM with splitting on, off, and on with images shrunk to one tile (never split)."""
    split = save_smolvlm(tmp_path_factory.mktemp("smolvlm_split")).path
    whole = save_smolvlm(tmp_path_factory.mktemp("smolvlm_whole"), splitting=False).path
    one_tile = Path(shutil.copytree(split, tmp_path_factory.mktemp("smolvlm_one_tile") / "model"))
    config = json.loads((one_tile / "preprocessor_config.json").read_text())
    config["size"] = {"longest_edge": TILE}
    (one_tile / "preprocessor_config.json").write_text(json.dumps(config))
    return {"split": split, "whole": whole, "one_tile": one_tile}


@pytest.fixture(scope="module")
def processors(folders: dict[str, Path]) -> dict[str, Any]:
    return {name: hf().AutoProcessor.from_pretrained(path) for name, path in folders.items()}


def _image(height: int, width: int) -> np.ndarray:
    return np.random.default_rng(height * 1000 + width).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("mode", ["split", "whole", "one_tile"])
@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
def test_matches_transformers(folders: dict[str, Path], processors: dict[str, Any], mode: str, size: str) -> None:
    processor = processors[mode]
    pixels = _image(*SIZES[size])
    prompt = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = processor(text=prompt, images=[Image.fromarray(pixels)], return_tensors="np")

    processing = Idefics3Processing.from_folder(folders[mode])
    prepared = processing.prepare(pixels)

    assert prepared.tiles.dtype == np.uint8  # the encoder's input only when it runs (normalize)
    np.testing.assert_array_equal(processing.normalize(prepared.tiles), expected["pixel_values"][0])
    ids = processor.tokenizer(prompt.replace("<image>", prepared.text))["input_ids"]
    assert ids == expected["input_ids"][0].tolist()


def test_reads_the_folder(folders: dict[str, Path]) -> None:
    processing = Idefics3Processing.from_folder(folders["split"])
    assert (processing.longest_edge, processing.tile_size, processing.image_seq_len) == (LONGEST_EDGE, TILE, SEQ_LEN)
    assert processing.do_image_splitting and not Idefics3Processing.from_folder(folders["whole"]).do_image_splitting
    assert processing.resample == Image.Resampling.LANCZOS


def test_transformers5_layout(folders: dict[str, Path], tmp_path: Path) -> None:
    """transformers 5 saves the image processor inside processor_config.json; both layouts read the same."""
    for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
        shutil.copy(folders["split"] / name, tmp_path / name)
    nested = json.loads((tmp_path / "processor_config.json").read_text())
    nested["image_processor"] = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    (tmp_path / "preprocessor_config.json").unlink()
    assert Idefics3Processing.from_folder(tmp_path) == Idefics3Processing.from_folder(folders["split"])


def test_prompt_text_layout() -> None:
    processing = Idefics3Processing(longest_edge=4, tile_size=2, image_seq_len=2)
    tile = "<image><image>"
    whole = f"<fake_token_around_image><global-img>{tile}<fake_token_around_image>"
    assert processing.prompt_text(0, 0) == whole
    assert processing.prompt_text(2, 1) == (f"<fake_token_around_image><row_1_col_1>{tile}\n"
                                            f"<fake_token_around_image><row_2_col_1>{tile}\n\n{whole}")


def test_rejects_non_rgb_uint8() -> None:
    processing = Idefics3Processing(longest_edge=4, tile_size=2, image_seq_len=2)
    with pytest.raises(ValueError, match="uint8"):
        processing.prepare(np.zeros((4, 4, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        processing.prepare(np.zeros((4, 4, 3), dtype=np.float32))
