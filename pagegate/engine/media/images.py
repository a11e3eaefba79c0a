"""Untrusted images in: a data: or http(s) URL, base64, bytes or a PIL image -> checked RGB pixels and their digest.

Every refusal is an ImageError (a 400) that names the request part and says what to send instead; an image's byte
size and pixel count are checked before it is decoded. Torch-free: the gateway imports it."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from pagegate.engine.media.limits import ImageError, ImageLimits

DIGEST_TAG = b"pagegate-image-v1"
# a declared media type -> the format its bytes must be (PIL's name for it)
MEDIA_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                 "image/gif": "GIF"}
_FORMAT_MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
_ACCEPTED = "image/png, image/jpeg, image/webp or image/gif"
_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class DecodedImage:
    """One decoded image: `pixels` uint8 [H, W, 3] RGB, C-contiguous and read-only; `digest` its identity (SHA-256
    of the pixels and their shape), the same however the image was encoded."""

    pixels: np.ndarray
    digest: bytes


def image_from_url(url: str, param: str, limits: ImageLimits) -> DecodedImage:
    """A data: URL, or an http(s) URL whose host is in `limits.allowed_domains`; any other scheme is refused
    without touching anything."""
    colon = url.find(":", 0, 16)  # a bounded look: a data: URL may be megabytes long
    scheme = url[:colon].lower() if colon > 0 else ""
    if scheme == "data":
        return _from_data_url(url, param, limits)
    if scheme in ("http", "https"):
        data, media_type = _fetch(url, param, limits)
        return image_from_bytes(data, param, limits, media_type)
    shown = f"scheme {scheme[:16]!r}" if scheme else "no scheme"
    raise _error(param, f"its URL has {shown}; send a data:image/png;base64,... URL (or an http(s) URL from a host "
                        "this server fetches images from)")


def image_from_base64(data: str, media_type: str | None, param: str, limits: ImageLimits) -> DecodedImage:
    """Standard base64 (no whitespace, no URL-safe alphabet), its size checked from its length before decoding."""
    declared = _declared(media_type, param)
    size = len(data) * 3 // 4 - (2 if data.endswith("==") else 1 if data.endswith("=") else 0)
    if size > limits.max_bytes:
        raise _too_large(param, f"about {size}", limits)
    return image_from_bytes(_b64decode(data, param), param, limits, declared)


def image_from_bytes(data: bytes, param: str, limits: ImageLimits, media_type: str | None = None) -> DecodedImage:
    """An encoded PNG, JPEG, WebP or GIF (the first frame); its real format must match `media_type` if given."""
    if len(data) > limits.max_bytes:
        raise _too_large(param, str(len(data)), limits)
    declared = _declared(media_type, param)
    actual = _sniff(data)
    if actual is None:
        raise _error(param, f"its bytes are not a PNG, JPEG, WebP or GIF image; send one of {_ACCEPTED}")
    if declared is not None and MEDIA_FORMATS[declared] != actual:
        raise _error(param, f"it is declared as {declared}, but its bytes are a {actual} image "
                            f"(mislabelled); declare it as {_FORMAT_MEDIA[actual]}")
    with _decoding(param, limits), Image.open(io.BytesIO(data), formats=[actual]) as image:
        _check_pixels(image.size, param, limits)  # from the header: nothing is decoded yet
        image.load()
        return _finish(image, param, limits)


def image_from_pil(image: Image.Image, param: str, limits: ImageLimits) -> DecodedImage:
    """A PIL image of the offline API (the frame it is on), checked and converted like any other."""
    if not isinstance(image, Image.Image):
        raise _error(param, f"expected a PIL image, got {type(image).__name__}")
    with _decoding(param, limits):
        _check_pixels(image.size, param, limits)
        image.load()
        return _finish(image, param, limits)


def _error(param: str, what: str) -> ImageError:
    return ImageError(f"Image '{param}': {what}.", param)


def _too_large(param: str, size: str, limits: ImageLimits) -> ImageError:
    return _error(param, f"it is {size} bytes, more than the {limits.max_bytes} accepted; send a smaller or more "
                         "compressed image")


def _declared(media_type: str | None, param: str) -> str | None:
    """A declared media type -> its canonical form (image/jpg -> image/jpeg); None when none was declared."""
    if media_type is None:
        return None
    name = media_type.partition(";")[0].strip().lower()
    if name not in MEDIA_FORMATS:
        raise _error(param, f"its media type {name[:64]!r} is not an accepted image type; send {_ACCEPTED}")
    return _FORMAT_MEDIA[MEDIA_FORMATS[name]]


def _from_data_url(url: str, param: str, limits: ImageLimits) -> DecodedImage:
    """`data:<media type>[;parameters];base64,<payload>`."""
    comma = url.find(",")
    if comma < 0:
        raise _error(param, "its data: URL has no ',' before the payload; send data:image/png;base64,<base64>")
    header, payload = url[len("data:"):comma], url[comma + 1:]
    media_type, *parameters = header.split(";")
    _declared(media_type or "text/plain", param)  # RFC 2397: no media type means text/plain
    if not parameters or parameters[-1].strip().lower() != "base64":
        raise _error(param, "its data: URL is not base64; send data:image/png;base64,<base64>")
    return image_from_base64(payload, media_type, param, limits)


def _b64decode(data: str, param: str) -> bytes:
    # NOTE: strict: whitespace and line breaks are refused, not stripped, so the size checked from the length
    # before decoding is the size decoded; every client library's encoder writes none.
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:  # binascii.Error, or a non-ASCII character
        spaced = any(c in data for c in " \t\r\n")
        hint = "it holds whitespace or line breaks" if spaced else "it is not valid standard base64"
        raise _error(param, f"its base64 payload cannot be decoded: {hint}; send the bytes base64-encoded on one "
                            "line (RFC 4648, with padding)") from None


def _sniff(data: bytes) -> str | None:
    """The format the bytes' magic number says, whatever was declared."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _pixel_cap(limits: ImageLimits) -> int:
    # NOTE: PIL only warns (and decodes) above its own MAX_IMAGE_PIXELS, and raises above twice that; capping at
    # its limit too means an image PIL would warn about is always refused here, whatever the warning filters say.
    return min(limits.max_pixels, Image.MAX_IMAGE_PIXELS or limits.max_pixels)


def _check_pixels(size: tuple[int, int], param: str, limits: ImageLimits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise _error(param, f"it is {width}x{height} pixels, which is empty")
    if width * height > _pixel_cap(limits):
        raise _error(param, f"it is {width}x{height} = {width * height} pixels, more than the "
                            f"{_pixel_cap(limits)} accepted; send a smaller image")


@contextmanager
def _decoding(param: str, limits: ImageLimits) -> Iterator[None]:
    """Whatever PIL raises while reading untrusted bytes -> ImageError."""
    try:
        yield
    except (ImageError, MemoryError):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _error(param, f"it has more than the {_pixel_cap(limits)} pixels accepted; send a smaller "
                            "image") from exc
    except Image.UnidentifiedImageError as exc:  # its message holds the buffer's repr
        raise _error(param, "its header cannot be read; the file is truncated or corrupt: send a complete PNG, "
                            "JPEG, WebP or GIF") from exc
    # NOTE: on hostile input PIL's plugins raise OSError, SyntaxError, ValueError, EOFError, struct.error,
    # IndexError, KeyError, TypeError...; any of them means the client's image is broken, never a 500.
    except Exception as exc:
        raise _error(param, f"it cannot be decoded ({type(exc).__name__}: {str(exc)[:200]}); the file is "
                            "truncated or corrupt: send a complete PNG, JPEG, WebP or GIF") from exc


def _finish(image: Image.Image, param: str, limits: ImageLimits) -> DecodedImage:
    """A loaded image -> upright RGB pixels, as transformers' load_image (EXIF orientation) and convert_to_rgb
    (alpha composited onto white) make them."""
    _check_pixels(image.size, param, limits)  # the output keeps the cap too, whatever load() did
    rgb = _to_rgb(ImageOps.exif_transpose(image))
    pixels = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))
    pixels.flags.writeable = False
    return DecodedImage(pixels, _digest(pixels))


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers.image_transforms.convert_to_rgb on a PIL image: transparency goes onto a white background."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _digest(pixels: np.ndarray) -> bytes:
    """SHA-256 of the record (tag length, tag, height u32, width u32, RGB bytes), all little-endian."""
    height, width = pixels.shape[:2]
    record = hashlib.sha256(struct.pack("<I", len(DIGEST_TAG)) + DIGEST_TAG + struct.pack("<II", height, width))
    record.update(pixels.data)
    return record.digest()


def _fetch(url: str, param: str, limits: ImageLimits) -> tuple[bytes, str | None]:
    """GET an allowed host's image within `fetch_timeout_s` in all -> (body, its image Content-Type or None)."""
    import httpx  # here, not at import: ~50 ms of a gateway's start-up, for servers that fetch images only
    try:
        host = httpx.URL(url).host.lower()
    except (httpx.InvalidURL, ValueError):
        raise _error(param, "its URL is not a valid http(s) URL") from None
    if not host or host not in {domain.lower() for domain in limits.allowed_domains}:
        raise _error(param, f"this server does not fetch images from {host[:100]!r} (its --allowed-media-domains "
                            "does not name it); send the image inline as a data:image/png;base64,... URL")
    # NOTE: httpx's timeouts are per network wait, so a server trickling bytes could outlast them; the fetch runs
    # on a worker thread that the caller waits for until the deadline. A late worker stops at its next chunk.
    deadline = time.monotonic() + limits.fetch_timeout_s
    outcome: list[tuple[bytes, str | None] | Exception] = []
    worker = threading.Thread(target=_fetch_into, args=(outcome, url, host, param, limits, deadline),
                              name="image-fetch", daemon=True)
    worker.start()
    worker.join(limits.fetch_timeout_s)
    if not outcome:
        raise _error(param, f"fetching it from {host!r} took longer than {limits.fetch_timeout_s} s; send the "
                            "image inline as a data:image/png;base64,... URL")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _fetch_into(outcome: list[tuple[bytes, str | None] | Exception], url: str, host: str, param: str,
                limits: ImageLimits, deadline: float) -> None:
    """The worker: fetch, then append the result or the ImageError to `outcome`."""
    import httpx
    try:
        outcome.append(_get(url, host, param, limits, deadline))
    except ImageError as exc:
        outcome.append(exc)
    except httpx.TimeoutException:
        outcome.append(_error(param, f"fetching it from {host!r} took longer than {limits.fetch_timeout_s} s"))
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
        outcome.append(_error(param, f"it could not be fetched from {host!r} ({type(exc).__name__}); send the "
                                     "image inline as a data:image/png;base64,... URL"))
    except Exception as exc:  # a bug: the caller re-raises it (a 500); the worker must not swallow it
        outcome.append(exc)


def _get(url: str, host: str, param: str, limits: ImageLimits, deadline: float) -> tuple[bytes, str | None]:
    # NOTE: redirects are refused, not followed: following one would need every hop's host checked against the
    # allowed list; trust_env=False so no proxy, netrc credential or CA setting of the server's environment applies.
    import httpx
    headers = {"Accept": "image/*", "Accept-Encoding": "identity"}
    with httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=False, trust_env=False) as client, \
            client.stream("GET", url, headers=headers) as response:
        if response.is_redirect:
            raise _error(param, f"{host!r} answered with a redirect (HTTP {response.status_code}), which is not "
                                "followed; send the image's final URL")
        if not response.is_success:
            raise _error(param, f"{host!r} answered HTTP {response.status_code} instead of the image")
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > limits.max_bytes:
            raise _too_large(param, length, limits)
        chunks: list[bytes] = []
        received = 0
        for chunk in response.iter_bytes(_CHUNK_BYTES):
            received += len(chunk)
            if received > limits.max_bytes:  # Content-Length may be absent or lie
                raise _too_large(param, f"more than {limits.max_bytes}", limits)
            if time.monotonic() > deadline:
                raise _error(param, f"fetching it from {host!r} took longer than {limits.fetch_timeout_s} s")
            chunks.append(chunk)
        content_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    return b"".join(chunks), content_type if content_type.startswith("image/") else None
