"""A prompt's text with its images in place: each image placeholder becomes the text the family's processor writes
for that image (its tiles' tokens and markers), and the image its (digest, tiles) for the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagegate.engine.errors import InvalidParamError

if TYPE_CHECKING:
    import numpy as np

    from pagegate.engine.media.images import DecodedImage
    from pagegate.engine.media.processing import ImageProcessing

PlacedImage = tuple[bytes, "np.ndarray"]  # (digest, uint8 tiles [n, S, S, 3]), as the engine takes an image


def place_images(text: str, images: Sequence[DecodedImage], processing: ImageProcessing,
                 param: str) -> tuple[str, list[PlacedImage]]:
    """`text` with its i-th image placeholder replaced by image i's prompt text; InvalidParamError (naming
    `param`) when the placeholders and the images do not pair up."""
    pieces = text.split(processing.image_token)
    if len(pieces) - 1 != len(images):
        raise InvalidParamError(f"the prompt holds {len(pieces) - 1} image placeholder(s) "
                                f"({processing.image_token}) for {len(images)} image(s)", param)
    written, placed = [pieces[0]], []
    for image, piece in zip(images, pieces[1:], strict=True):
        prepared = processing.prepare(image.pixels)
        written += [prepared.text, piece]
        placed.append((image.digest, prepared.tiles))
    return "".join(written), placed


def template_parts(messages: list[dict[str, Any]], image_token: str) -> list[dict[str, Any]]:
    """Each message's text content as parts, as vision templates iterate them (transformers' processors pass them
    so): the text between `image_token`s as text parts, each `image_token` an image part."""
    return [{**item, "content": _parts(item["content"], image_token)} if isinstance(item.get("content"), str)
            else item for item in messages]


def _parts(text: str, image_token: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(image_token)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]
