"""Gemma 3 image preprocessing against transformers' Gemma3Processor on the tiny Gemma 3: the same pixel values, bit
for bit, and the same prompt token ids once our text replaces the `<start_of_image>` placeholder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.media.gemma3 import Gemma3Processing
from pagegate.engine.media.images import ImageLimits, image_from_pil
from tests.engine.conftest import hf
from tests.engine.vision_models import GEMMA3_SEQ_LEN, GEMMA3_TILE, save_gemma3_vision

SIZES = {"tiny": (20, 30), "odd": (77, 131), "wide": (90, 300), "tall": (300, 90), "tile": (56, 56),
         "off_by_one": (57, 56), "large": (500, 700), "pixel": (1, 1)}  # (height, width)
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                         {"type": "text", "text": "What is this?"}]}]
# gemma-3-4b-it's own processor files (config.json: the fields the preprocessing reads)
GEMMA3_4B_PREPROCESSOR = {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
                          "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type":
                          "Gemma3ImageProcessor", "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5],
                          "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
                          "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor",
                          "resample": 2, "rescale_factor": 0.00392156862745098,
                          "size": {"height": 896, "width": 896}}
GEMMA3_4B_CONFIG = {"mm_tokens_per_image": 256, "vision_config": {"image_size": 896, "patch_size": 14}}
GEMMA3_4B_TOKENIZER = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_gemma3_vision(tmp_path_factory.mktemp("gemma3")).path


@pytest.fixture(scope="module")
def processor(folder: Path) -> Any:
    """transformers' PIL backend, named: AutoProcessor's default only where torchvision is not installed."""
    transformers: Any = hf()
    return transformers.AutoProcessor.from_pretrained(folder, backend="pil")


def _image(height: int, width: int) -> np.ndarray:
    return np.random.default_rng(height * 1000 + width).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _check(processing: Gemma3Processing, processor: Any, pixels: np.ndarray, image: Image.Image) -> None:
    """Our tile and text for `pixels` give what transformers gives for `image`."""
    prompt = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = processor(text=prompt, images=[image], return_tensors="np")
    prepared = processing.prepare(pixels)

    assert prepared.tiles.dtype == np.uint8 and prepared.tiles.shape == (1, GEMMA3_TILE, GEMMA3_TILE, 3)
    values = processing.normalize(prepared.tiles)
    assert values.dtype == expected["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(values, expected["pixel_values"])
    ids = processor.tokenizer(prompt.replace(processing.image_token, prepared.text))["input_ids"]
    assert ids == expected["input_ids"][0].tolist()


@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
def test_matches_transformers(folder: Path, processor: Any, size: str) -> None:
    pixels = _image(*SIZES[size])
    _check(Gemma3Processing.from_folder(folder), processor, pixels, Image.fromarray(pixels))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P"])
def test_converted_images_match_transformers(folder: Path, processor: Any, mode: str) -> None:
    """An image with alpha or without colour reaches us as images.py's RGB pixels; transformers converts the
    original itself (alpha onto white): the same tile."""
    rgba = np.random.default_rng(5).integers(0, 256, (70, 90, 4), dtype=np.uint8)
    image = Image.fromarray(rgba, mode="RGBA").convert(mode)
    pixels = image_from_pil(image, "images.0", ImageLimits()).pixels
    _check(Gemma3Processing.from_folder(folder), processor, pixels, image)


def test_the_text_is_the_processors_full_image_sequence(folder: Path, processor: Any) -> None:
    processing = Gemma3Processing.from_folder(folder)
    assert processing.prompt_text() == processor.full_image_sequence
    assert processing.prompt_text() == ("\n\n<start_of_image>" + "<image_soft_token>" * GEMMA3_SEQ_LEN
                                        + "<end_of_image>\n\n")
    assert processing.image_token == "<start_of_image>" == processor.image_token  # what the chat template writes


def test_reads_the_folder(folder: Path, tmp_path: Path) -> None:
    processing = Gemma3Processing.from_folder(folder)
    assert (processing.tile_size, processing.image_seq_len) == (GEMMA3_TILE, GEMMA3_SEQ_LEN)
    assert processing.resample == Image.Resampling.BILINEAR
    # transformers 5 saves the image processor inside processor_config.json: both layouts read the same
    for name in ("config.json", "preprocessor_config.json", "processor_config.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    nested = json.loads((tmp_path / "processor_config.json").read_text())
    nested["image_processor"] = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    (tmp_path / "preprocessor_config.json").unlink()
    assert Gemma3Processing.from_folder(tmp_path) == processing


def test_reads_gemma3_4b_configs() -> None:
    processing = Gemma3Processing.from_config(GEMMA3_4B_PREPROCESSOR, {"image_seq_length": 256}, GEMMA3_4B_CONFIG,
                                              GEMMA3_4B_TOKENIZER)
    assert (processing.tile_size, processing.image_seq_len) == (896, 256)
    assert processing.prompt_text().count("<image_soft_token>") == 256
    prepared = processing.prepare(_image(30, 40))
    assert prepared.tiles.shape == (1, 896, 896, 3)
    assert Gemma3Processing.from_config(GEMMA3_4B_PREPROCESSOR, {}, GEMMA3_4B_CONFIG) == processing


@pytest.mark.parametrize(("change", "match"), [({"do_pan_and_scan": True}, "pan-and-scan"),
                                               ({"size": {"height": 448, "width": 448}}, "tower takes 896"),
                                               ({"size": {"height": 896, "width": 448}}, "square"),
                                               ({"do_resize": False}, "do_resize")])
def test_refuses_what_it_does_not_match(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        Gemma3Processing.from_config({**GEMMA3_4B_PREPROCESSOR, **change}, {}, GEMMA3_4B_CONFIG)


def test_rejects_non_rgb_uint8() -> None:
    processing = Gemma3Processing(tile_size=4, image_seq_len=1)
    with pytest.raises(ValueError, match="uint8"):
        processing.prepare(np.zeros((4, 4, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        processing.prepare(np.zeros((4, 4, 3), dtype=np.float32))
