"""SmolVLM / Idefics3 image preprocessing: one decoded RGB image -> the tiles the vision tower reads and the prompt
text that stands for it, exactly as transformers' Idefics3Processor (its PIL image path) produces them.
Torch-free: the gateway imports it to expand `<image>` placeholders and count prompt tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.media.preprocess import PreparedImage, read_json, rescale_normalize, three

# NOTE: transformers caps a resized image's longest edge at 4096 pixels whatever the config says; so do we.
MAX_IMAGE_SIZE = 4096
LANCZOS = 1  # PIL's Image.Resampling.LANCZOS (PIL is imported where an image is resized)
# transformers' Idefics3ImageProcessor defaults, for keys a preprocessor config leaves out
_DEFAULTS: dict[str, Any] = {"size": {"longest_edge": 4 * 364}, "max_image_size": {"longest_edge": 364},
                             "resample": LANCZOS, "do_resize": True, "do_rescale": True,
                             "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                             "image_std": [0.5, 0.5, 0.5], "do_image_splitting": True}


@dataclass(frozen=True)
class Idefics3Processing:
    """The image preprocessing of one Idefics3 / SmolVLM checkpoint (its processor configs and config.json)."""

    longest_edge: int  # images are first resized so their longest edge is this (up or down)
    tile_size: int  # the vision tower's square input (max_image_size.longest_edge)
    image_seq_len: int  # image tokens per tile
    do_image_splitting: bool = True
    resample: int = LANCZOS
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_token: str = "<image>"
    fake_image_token: str = "<fake_token_around_image>"
    global_image_token: str = "<global-img>"

    @property
    def soft_token(self) -> str:
        """The token whose embeddings the encoder's rows replace: the placeholder itself."""
        return self.image_token

    @classmethod
    def from_folder(cls, folder: Path) -> Idefics3Processing:
        """Read preprocessor_config.json (or processor_config.json's `image_processor`, transformers 5's layout),
        processor_config.json and config.json."""
        processor = read_json(folder / "processor_config.json")
        preprocessor = read_json(folder / "preprocessor_config.json") or processor.get("image_processor") or {}
        return cls.from_config(preprocessor, processor, read_json(folder / "config.json"))

    @classmethod
    def from_config(cls, preprocessor: dict[str, Any], processor: dict[str, Any],
                    config: dict[str, Any]) -> Idefics3Processing:
        """From the three configs as dicts (a GGUF file's metadata can be mapped onto them)."""
        image = {**_DEFAULTS, **preprocessor}
        if "longest_edge" not in image["size"]:
            raise ModelLoadError(f"Idefics3 image size {image['size']} has no longest_edge")
        return cls(longest_edge=int(image["size"]["longest_edge"]),
                   tile_size=int(image["max_image_size"]["longest_edge"]),
                   image_seq_len=int(processor.get("image_seq_len") or _model_seq_len(config)),
                   do_image_splitting=bool(image["do_image_splitting"]), resample=int(image["resample"]),
                   do_resize=bool(image["do_resize"]), do_rescale=bool(image["do_rescale"]),
                   rescale_factor=float(image["rescale_factor"]), do_normalize=bool(image["do_normalize"]),
                   image_mean=three(image["image_mean"]), image_std=three(image["image_std"]))

    def prepare(self, pixels: np.ndarray) -> PreparedImage:
        """A decoded RGB image, uint8 [H, W, 3] -> its tiles and prompt text."""
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"expected a uint8 [H, W, 3] RGB image, got {pixels.dtype} {list(pixels.shape)}")
        image = pixels
        if self.do_resize:
            image = self._resize(image, _longest_edge_size(image.shape[0], image.shape[1], self.longest_edge))
        if self.do_image_splitting:
            image = self._resize(image, _tile_multiple_size(image.shape[0], image.shape[1], self.tile_size))
            frames, rows, cols = self._split(image)
        else:
            frames, rows, cols = [self._resize(image, (self.tile_size, self.tile_size))], 0, 0
        return PreparedImage(np.stack(frames), self.prompt_text(rows, cols))

    def prompt_text(self, rows: int, cols: int) -> str:
        """The text for an image cut into rows x cols tiles plus its global image (0 x 0: the global image alone)."""
        tile = self.image_token * self.image_seq_len
        whole = f"{self.fake_image_token}{self.global_image_token}{tile}{self.fake_image_token}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{self.fake_image_token}<row_{r}_col_{c}>{tile}" for c in range(1, cols + 1)) + "\n"
                       for r in range(1, rows + 1))
        return f"{grid}\n{whole}"

    def _resize(self, image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        """uint8 [H, W, 3] -> uint8 [height, width, 3] with the checkpoint's PIL filter, as transformers does."""
        from PIL import Image

        height, width = size
        resized = Image.fromarray(image).resize((width, height), resample=Image.Resampling(self.resample))
        return np.asarray(resized)

    def _split(self, image: np.ndarray) -> tuple[list[np.ndarray], int, int]:
        """Row-major tile crops of an image whose sides are multiples of the tile, then the whole image shrunk to
        one tile; an image of one tile stays one frame and counts as 0 x 0."""
        height, width = image.shape[:2]
        size = self.tile_size
        if height <= size and width <= size:
            return [image], 0, 0
        rows, cols = (height - size) // size + 1, (width - size) // size + 1
        crops = [image[r * size:(r + 1) * size, c * size:(c + 1) * size] for r in range(rows) for c in range(cols)]
        return [*crops, self._resize(image, (size, size))], rows, cols

    def normalize(self, frames: np.ndarray) -> np.ndarray:
        """uint8 tiles [n, S, S, 3] -> the encoder's float32 input [n, 3, S, S], rescaled then normalized."""
        return rescale_normalize(frames, self.rescale_factor if self.do_rescale else None,
                                 (self.image_mean, self.image_std) if self.do_normalize else None)


def _longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """The size with the longest edge at `longest_edge` (scaling up or down), the other edge truncated and rounded
    up to even, then capped at MAX_IMAGE_SIZE; transformers' arithmetic, truncations included."""
    aspect = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides rounded up to multiples of the tile, the shorter one from the aspect ratio, as transformers does."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _model_seq_len(config: dict[str, Any]) -> int:
    """Image tokens per tile implied by the model: (patches per side / scale factor)^2."""
    vision = config.get("vision_config", {})
    patches = vision.get("image_size", 224) // vision.get("patch_size", 32)
    return int(patches**2 / config.get("scale_factor", 2) ** 2)
