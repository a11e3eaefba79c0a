"""Gemma 3 image preprocessing: one decoded RGB image -> the square image its SigLIP tower reads and the prompt text
that stands for it, exactly as transformers' Gemma3Processor produces them. Torch-free: the gateway imports it to
expand `<start_of_image>` placeholders and count prompt tokens.

NOTE: transformers 5 has two Gemma 3 image processors, and AutoProcessor picks torchvision's where torchvision is
importable, the PIL one otherwise. This is the PIL one (pagegate does not depend on torchvision): torchvision resizes
with torch's int16-weight kernel, a level apart from Pillow's on some pixels, and normalizes an ulp apart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.media.preprocess import PreparedImage, read_json, rescale_normalize, three

BILINEAR = 2  # PIL's Image.Resampling.BILINEAR (PIL is imported where an image is resized)
# transformers' Gemma3ImageProcessor and Gemma3Processor defaults, for keys the configs leave out (a published
# preprocessor_config.json writes null for the pan-and-scan keys: the processor's own default, off, applies)
_DEFAULTS: dict[str, Any] = {"size": {"height": 224, "width": 224}, "resample": BILINEAR,
                             "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": False}


@dataclass(frozen=True)
class Gemma3Processing:
    """The image preprocessing of one Gemma 3 checkpoint (its processor configs, tokenizer_config.json and
    config.json). Every image becomes one tile: the whole image resized (aspect ratio not kept) to the tower's
    square; pan-and-scan crops are not supported."""

    tile_size: int  # the tower's square input (the preprocessor's size, the vision config's image_size)
    image_seq_len: int  # image tokens per image (mm_tokens_per_image)
    resample: int = BILINEAR
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_token: str = "<start_of_image>"  # the placeholder the chat template writes for an image (boi)
    soft_token: str = "<image_soft_token>"  # the token whose embeddings the encoder's rows replace
    end_token: str = "<end_of_image>"  # eoi

    @classmethod
    def from_folder(cls, folder: Path) -> Gemma3Processing:
        """Read preprocessor_config.json (or processor_config.json's `image_processor`, transformers 5's layout),
        processor_config.json, tokenizer_config.json and config.json."""
        processor = read_json(folder / "processor_config.json")
        preprocessor = read_json(folder / "preprocessor_config.json") or processor.get("image_processor") or {}
        return cls.from_config(preprocessor, processor, read_json(folder / "config.json"),
                               read_json(folder / "tokenizer_config.json"))

    @classmethod
    def from_config(cls, preprocessor: dict[str, Any], processor: dict[str, Any], config: dict[str, Any],
                    tokenizer: dict[str, Any] | None = None) -> Gemma3Processing:
        """From the configs as dicts (a GGUF file's metadata can be mapped onto them)."""
        image = {**_DEFAULTS, **{key: value for key, value in preprocessor.items() if value is not None}}
        if image["do_pan_and_scan"]:
            raise ModelLoadError("this Gemma 3 checkpoint turns pan-and-scan on (do_pan_and_scan in its "
                                 "preprocessor config): its extra crops are not supported; set it to false")
        if not image["do_resize"]:
            raise ModelLoadError("Gemma 3 images are resized to the vision tower's square; do_resize false is not "
                                 "supported")
        size = image["size"]
        if size.get("height") is None or size.get("height") != size.get("width"):
            raise ModelLoadError(f"Gemma 3 image size {size} is not a square height x width")
        tile = int(size["height"])
        tower = int(config.get("vision_config", {}).get("image_size", tile))
        if tile != tower:
            raise ModelLoadError(f"the image processor resizes to {tile} pixels, the vision tower takes {tower}")
        tokens = _tokens(tokenizer or {})
        seq_len = processor.get("image_seq_length") or config.get("mm_tokens_per_image") or 256
        return cls(tile_size=tile, image_seq_len=int(seq_len), resample=int(image["resample"]),
                   do_rescale=bool(image["do_rescale"]), rescale_factor=float(image["rescale_factor"]),
                   do_normalize=bool(image["do_normalize"]), image_mean=three(image["image_mean"]),
                   image_std=three(image["image_std"]), **tokens)

    def prompt_text(self) -> str:
        """The prompt text of one image: the processor's full image sequence, blank lines around it."""
        return f"\n\n{self.image_token}{self.soft_token * self.image_seq_len}{self.end_token}\n\n"

    def prepare(self, pixels: np.ndarray) -> PreparedImage:
        """A decoded RGB image, uint8 [H, W, 3] -> its one tile [1, S, S, 3] and prompt text."""
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"expected a uint8 [H, W, 3] RGB image, got {pixels.dtype} {list(pixels.shape)}")
        from PIL import Image

        size = self.tile_size
        tile = np.asarray(Image.fromarray(pixels).resize((size, size), resample=Image.Resampling(self.resample)))
        return PreparedImage(tile[None], self.prompt_text())

    def normalize(self, frames: np.ndarray) -> np.ndarray:
        """uint8 tiles [n, S, S, 3] -> the encoder's float32 input [n, 3, S, S], as transformers computes it."""
        return rescale_normalize(frames, self.rescale_factor if self.do_rescale else None,
                                 (self.image_mean, self.image_std) if self.do_normalize else None)


def _tokens(tokenizer: dict[str, Any]) -> dict[str, str]:
    """The image tokens a tokenizer_config.json names (top level, as gemma-3-4b-it's, or in extra_special_tokens,
    as transformers 5 saves them); Gemma 3's own where it names none."""
    extra = tokenizer.get("extra_special_tokens")
    named = {**tokenizer, **(extra if isinstance(extra, dict) else {})}
    fields = {"boi_token": "image_token", "image_token": "soft_token", "eoi_token": "end_token"}
    return {field: str(named[key]) for key, field in fields.items() if isinstance(named.get(key), str)}
