"""What one request's images may cost, and the error a refused image is: apart from images.py (PIL, numpy) so that
a gateway whose clients send no image never imports the decoders."""

from __future__ import annotations

from dataclasses import dataclass

from pagegate.engine.errors import InvalidParamError


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may cost the server."""

    max_bytes: int = 20 * 2**20  # an encoded image (after base64 decoding)
    max_pixels: int = 8192 * 8192 // 4  # width * height of a decoded image (~16.7 M)
    max_images: int = 8  # images in one request (checked by check_count)
    fetch_timeout_s: float = 10.0  # a remote image's whole fetch
    allowed_domains: frozenset[str] = frozenset()  # hosts remote http(s) images may come from; empty: none

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_pixels, self.max_images) < 1 or self.fetch_timeout_s <= 0:
            raise ValueError(f"image limits must be positive: {self}")


class ImageError(InvalidParamError):
    """An image the server will not decode; the message says why and names the part, `param` is its path."""

    def __init__(self, message: str, param: str, code: str = "invalid_image") -> None:
        super().__init__(message, param, code)


def check_count(count: int, param: str, limits: ImageLimits) -> None:
    """Refuse a request with more than `limits.max_images` images."""
    if count > limits.max_images:
        raise ImageError(f"'{param}' holds {count} images, but at most {limits.max_images} are accepted in one "
                         "request; send fewer images", param, code="too_many_images")
