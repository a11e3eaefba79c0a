"""Decoding untrusted images: round trips, transformers' RGB conversion, digests, every refusal, remote fetches."""

from __future__ import annotations

import base64
import io
import struct
import threading
import warnings
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile, ImageOps
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image

from pagegate.engine.media.images import (
    DecodedImage,
    image_from_base64,
    image_from_bytes,
    image_from_pil,
    image_from_url,
)
from pagegate.engine.media.limits import ImageError, ImageLimits, check_count

LIMITS = ImageLimits()
PART = "messages.0.content.1.image_url"


def _rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _png(height: int = 6, width: int = 7, seed: int = 0) -> bytes:
    return _encode(Image.fromarray(_rgb(height, width, seed)), "PNG")


def _refused(call, *args, param: str = PART, **kwargs) -> str:
    """Run `call`, which must refuse with an ImageError for `param`; its message."""
    with pytest.raises(ImageError) as caught:
        call(*args, **kwargs)
    assert caught.value.param == param
    assert f"'{param}'" in str(caught.value)
    return str(caught.value)


def _transformers_rgb(data: bytes) -> np.ndarray:
    """What transformers' vision processors see: load_image's EXIF transpose, then convert_to_rgb."""
    return np.asarray(convert_to_rgb(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), return_numpy=True))


# --- decoding ----------------------------------------------------------------------------------------------------

def test_png_round_trips_exactly_as_a_read_only_array() -> None:
    pixels = _rgb(13, 17)
    image = image_from_bytes(_encode(Image.fromarray(pixels), "PNG"), PART, LIMITS)
    assert isinstance(image, DecodedImage)
    np.testing.assert_array_equal(image.pixels, pixels)
    assert image.pixels.dtype == np.uint8 and image.pixels.flags.c_contiguous
    assert not image.pixels.flags.writeable
    with pytest.raises(ValueError):
        image.pixels[0, 0, 0] = 1


def test_every_entry_point_gives_the_same_image() -> None:
    data = _png()
    expected = image_from_bytes(data, PART, LIMITS)
    encoded = base64.b64encode(data).decode()
    for image in (image_from_url(_data_url(data), PART, LIMITS),
                  image_from_url("DATA:Image/PNG;charset=x;BASE64," + encoded, PART, LIMITS),
                  image_from_base64(encoded, "image/png", PART, LIMITS),
                  image_from_base64(encoded, None, PART, LIMITS),
                  image_from_bytes(data, PART, LIMITS, "image/png"),
                  image_from_pil(Image.open(io.BytesIO(data)), PART, LIMITS)):
        np.testing.assert_array_equal(image.pixels, expected.pixels)
        assert image.digest == expected.digest
    jpeg = _encode(Image.fromarray(_rgb(8, 8)), "JPEG")
    assert image_from_url(_data_url(jpeg, "image/jpg"), PART, LIMITS).pixels.shape == (8, 8, 3)


def _rgba_with_transparency() -> Image.Image:
    pixels = np.dstack([_rgb(5, 6), np.linspace(0, 255, 30).reshape(5, 6).astype(np.uint8)])
    return Image.fromarray(pixels, "RGBA")


def _palette_with_transparency() -> Image.Image:
    image = Image.fromarray(np.arange(30, dtype=np.uint8).reshape(5, 6) % 4, "L").convert("P")
    image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9] + [0] * 756)
    image.info["transparency"] = 1
    return image


def _cmyk() -> Image.Image:
    return Image.fromarray(np.random.default_rng(1).integers(0, 256, (6, 5, 4), dtype=np.uint8), "CMYK")


SAMPLES = {
    "rgba-png": lambda: _encode(_rgba_with_transparency(), "PNG"),
    "palette-transparency-png": lambda: _encode(_palette_with_transparency(), "PNG", transparency=1),
    "palette-transparency-gif": lambda: _encode(_palette_with_transparency(), "GIF", transparency=1),
    "la-png": lambda: _encode(_rgba_with_transparency().convert("LA"), "PNG"),
    "grayscale-png": lambda: _encode(Image.fromarray(_rgb(5, 6)[..., 0]), "PNG"),
    "16-bit-grayscale-png": lambda: _encode(Image.fromarray((np.arange(30) * 2000).astype(np.uint16).reshape(5, 6)),
                                            "PNG"),
    "rgb-jpeg": lambda: _encode(Image.fromarray(_rgb(9, 7)), "JPEG", quality=90),
    "cmyk-jpeg": lambda: _encode(_cmyk(), "JPEG"),
    "rgba-webp-lossless": lambda: _encode(_rgba_with_transparency(), "WEBP", lossless=True),
    "rgb-webp-lossy": lambda: _encode(Image.fromarray(_rgb(9, 7)), "WEBP", quality=80),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_rgb_conversion_matches_transformers(name: str) -> None:
    data = SAMPLES[name]()
    ours = image_from_bytes(data, PART, LIMITS).pixels
    np.testing.assert_array_equal(ours, _transformers_rgb(data))
    if "transparency" not in name and not name.startswith(("rgba", "la")):  # load_image drops alpha, not composites
        np.testing.assert_array_equal(ours, np.asarray(load_image(_data_url(data))))


def test_transparency_is_composited_onto_white() -> None:
    transparent = Image.new("RGBA", (3, 2), (10, 20, 30, 0))
    pixels = image_from_bytes(_encode(transparent, "PNG"), PART, LIMITS).pixels
    assert (pixels == 255).all()


def test_exif_orientation_is_applied_as_transformers_load_image_does() -> None:
    pixels = np.zeros((8, 16, 3), dtype=np.uint8)
    pixels[:, :8] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = _encode(Image.fromarray(pixels), "JPEG", exif=exif, quality=95)
    ours = image_from_bytes(data, PART, LIMITS).pixels
    assert ours.shape == (16, 8, 3)
    assert ours[1, 4, 0] > 200 and ours[-2, 4, 0] < 50  # the red left half is now on top
    np.testing.assert_array_equal(ours, np.asarray(load_image(_data_url(data, "image/jpeg"))))
    np.testing.assert_array_equal(ours, _transformers_rgb(data))


def _frames(fmt: str, **options: object) -> bytes:
    red, blue = (Image.new("RGB", (4, 3), color) for color in ((255, 0, 0), (0, 0, 255)))
    return _encode(red, fmt, save_all=True, append_images=[blue], duration=100, **options)


@pytest.mark.parametrize("fmt,options", [("GIF", {}), ("WEBP", {"lossless": True}), ("PNG", {})])
def test_animations_give_their_first_frame(fmt: str, options: dict) -> None:
    data = _frames(fmt, **options)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    pixels = image_from_bytes(data, PART, LIMITS).pixels
    assert pixels.shape == (3, 4, 3)
    assert (pixels == (255, 0, 0)).all()


def test_pil_images_are_converted_like_encoded_ones() -> None:
    image = _rgba_with_transparency()
    ours = image_from_pil(image, PART, LIMITS).pixels
    np.testing.assert_array_equal(ours, convert_to_rgb(image, return_numpy=True))
    assert image.mode == "RGBA"  # the caller's image is not converted in place


def test_digest_is_the_pixels_identity_whatever_the_encoding() -> None:
    pixels = _rgb(9, 11)
    png = image_from_bytes(_encode(Image.fromarray(pixels), "PNG"), PART, LIMITS)
    webp = image_from_bytes(_encode(Image.fromarray(pixels), "WEBP", lossless=True), PART, LIMITS)
    np.testing.assert_array_equal(png.pixels, webp.pixels)
    assert png.digest == webp.digest and len(png.digest) == 32
    other = pixels.copy()
    other[4, 5, 1] ^= 1
    assert image_from_pil(Image.fromarray(other), PART, LIMITS).digest != png.digest
    # the same bytes in another shape are another image
    flat = pixels.reshape(11, 9, 3)
    assert image_from_pil(Image.fromarray(flat), PART, LIMITS).digest != png.digest


# --- refusals -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("payload,hint", [("!!!!", "not valid standard base64"),
                                          ("iVBO\nRw0K", "whitespace"),
                                          ("iVBORw0KGgo", "not valid standard base64"),  # no padding
                                          ("iVBORw0KGgo=é", "not valid standard base64"),
                                          ("iVBO-_0K", "not valid standard base64")])
def test_bad_base64_is_refused(payload: str, hint: str) -> None:
    assert hint in _refused(image_from_base64, payload, "image/png", PART, LIMITS)
    assert hint in _refused(image_from_url, f"data:image/png;base64,{payload}", PART, LIMITS)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "javascript:alert(1)",
                                 "image.png", "//example.com/a.png", "gopher://127.0.0.1:70/"])
def test_other_schemes_are_refused(url: str) -> None:
    message = _refused(image_from_url, url, PART, ImageLimits(allowed_domains=frozenset({"example.com"})))
    assert "data:image/png;base64" in message


@pytest.mark.parametrize("url", ["data:text/plain;base64,aGVsbG8=", "data:application/pdf;base64,JVBERi0=",
                                 "data:image/svg+xml;base64,PHN2Zy8+", "data:;base64,aGVsbG8=",
                                 "data:,hello"])
def test_non_image_data_urls_are_refused(url: str) -> None:
    message = _refused(image_from_url, url, PART, LIMITS)
    assert "not an accepted image type" in message and "image/png" in message


def test_a_data_url_must_be_base64() -> None:
    assert "not base64" in _refused(image_from_url, "data:image/png,%89PNG", PART, LIMITS)
    assert "no ','" in _refused(image_from_url, "data:image/png;base64", PART, LIMITS)


def test_a_declared_media_type_must_be_an_image() -> None:
    assert "application/pdf" in _refused(image_from_base64, "aGVsbG8=", "application/pdf", PART, LIMITS)


def test_mislabelled_images_are_refused() -> None:
    message = _refused(image_from_url, _data_url(_png(), "image/jpeg"), PART, LIMITS)
    assert "image/jpeg" in message and "PNG" in message and "image/png" in message
    gif = _encode(Image.new("P", (2, 2)), "GIF")
    assert "GIF" in _refused(image_from_bytes, gif, PART, LIMITS, "image/webp")


@pytest.mark.parametrize("data", [b"", b"hello, world", b"%PDF-1.7\n", b"<svg xmlns='x'/>", b"BM" + bytes(60)])
def test_bytes_of_no_accepted_format_are_refused(data: bytes) -> None:
    _refused(image_from_bytes, data, PART, LIMITS)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_truncated_and_corrupt_images_are_refused(fmt: str) -> None:
    """(Zeros in a JPEG's entropy-coded data are not refused: libjpeg decodes them with a warning, in
    transformers too.)"""
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    data = _encode(Image.fromarray(_rgb(64, 64)), fmt)
    for broken in (data[:len(data) // 2], data[:40], data[:16] + b"\xff" * (len(data) - 16)):
        assert "truncated or corrupt" in _refused(image_from_bytes, broken, PART, LIMITS)


def _png_header(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR declares `width` x `height` RGB pixels (its pixel data is one empty zlib stream)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [5000, 10_000, 50_000])  # ours, PIL's warning, PIL's error
@pytest.mark.parametrize("warning_filter", ["ignore", "error"])
def test_decompression_bombs_are_refused_before_decoding(side: int, warning_filter: Literal["ignore", "error"],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[object] = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self))
    data = _png_header(side, side)
    assert len(data) < 100
    with warnings.catch_warnings():
        warnings.simplefilter(warning_filter)
        message = _refused(image_from_bytes, data, PART, LIMITS)
    assert "pixels" in message and "smaller image" in message
    assert not loads


def test_images_over_the_byte_cap_are_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _png(40, 40)
    limits = ImageLimits(max_bytes=len(data) - 1)
    assert str(len(data)) in _refused(image_from_bytes, data, PART, limits)
    monkeypatch.setattr(base64, "b64decode", lambda *args, **kwargs: pytest.fail("decoded"))
    assert "bytes" in _refused(image_from_url, _data_url(data), PART, limits)
    assert "bytes" in _refused(image_from_base64, base64.b64encode(data).decode(), None, PART, limits)


def test_images_over_the_pixel_cap_are_refused() -> None:
    limits = ImageLimits(max_pixels=100)
    image_from_bytes(_png(10, 10), PART, limits)
    assert "11x10 = 110 pixels" in _refused(image_from_bytes, _png(10, 11), PART, limits)
    assert "110 pixels" in _refused(image_from_pil, Image.new("RGB", (11, 10)), PART, limits)


def test_non_pil_objects_are_refused() -> None:
    assert "PIL image" in _refused(image_from_pil, np.zeros((2, 2, 3), np.uint8), PART, LIMITS)


def test_too_many_images_are_refused() -> None:
    check_count(8, "messages", LIMITS)
    message = _refused(check_count, 9, "messages", LIMITS, param="messages")
    assert "9 images" in message and "at most 8" in message


@pytest.mark.parametrize("url", ["http://example.com/a.png", "https://127.0.0.1.evil.test/a.png",
                                 "http://127.0.0.1@evil.test/a.png", "http://[::1]/a.png"])
def test_hosts_not_allowed_are_refused_without_a_fetch(url: str) -> None:
    limits = ImageLimits(allowed_domains=frozenset({"127.0.0.1"}))
    assert "does not fetch images from" in _refused(image_from_url, url, PART, limits)
    assert "does not fetch images from" in _refused(image_from_url, "http://example.com/a.png", PART, LIMITS)


# --- remote images ------------------------------------------------------------------------------------------------

PNG = _png(5, 4, seed=3)
STOP = threading.Event()


class _Images(BaseHTTPRequestHandler):
    """A few misbehaving image servers in one."""

    def do_GET(self) -> None:
        try:
            getattr(self, "_" + self.path.strip("/").replace("-", "_"), self._missing)()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up, as it should

    def _head(self, status: int = 200, content_type: str = "image/png", length: int | None = None,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()

    def _image(self, content_type: str = "image/png; charset=binary") -> None:
        self._head(content_type=content_type, length=len(PNG))
        self.wfile.write(PNG)

    def _octets(self) -> None:
        self._image("application/octet-stream")

    def _mislabelled(self) -> None:
        self._image("image/jpeg")

    def _svg(self) -> None:
        self._image("image/svg+xml")

    def _missing(self) -> None:
        self._head(404, "text/plain", length=9)
        self.wfile.write(b"not found")

    def _redirect(self) -> None:
        self._head(302, "text/plain", length=0, headers={"Location": "/image"})

    def _big(self) -> None:  # no Content-Length: the body ends when the connection closes
        self._head()
        for _ in range(64):
            self.wfile.write(bytes(64 * 1024))

    def _chunked(self) -> None:
        self.protocol_version = "HTTP/1.1"
        self._head(headers={"Transfer-Encoding": "chunked", "Connection": "close"})
        for _ in range(64):
            self.wfile.write(b"10000\r\n" + bytes(0x10000) + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def _slow(self) -> None:
        STOP.wait(5)
        self._image()

    def _trickle(self) -> None:
        self._head(length=len(PNG))
        for byte in PNG:
            if STOP.wait(0.02):
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    STOP.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    STOP.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


REMOTE = ImageLimits(allowed_domains=frozenset({"127.0.0.1"}), fetch_timeout_s=0.4, max_bytes=100_000)


@pytest.mark.parametrize("path", ["image", "octets"])
def test_an_allowed_host_is_fetched(server: str, path: str) -> None:
    image = image_from_url(f"{server}/{path}", PART, REMOTE)
    assert image.digest == image_from_bytes(PNG, PART, LIMITS).digest


@pytest.mark.parametrize("path,hint", [("missing", "HTTP 404"), ("redirect", "redirect (HTTP 302)"),
                                       ("big", "more than 100000"), ("chunked", "more than 100000"),
                                       ("slow", "longer than 0.4 s"), ("trickle", "longer than 0.4 s"),
                                       ("mislabelled", "mislabelled"), ("svg", "image/svg+xml")])
def test_misbehaving_servers_are_refused(server: str, path: str, hint: str) -> None:
    assert hint in _refused(image_from_url, f"{server}/{path}", PART, REMOTE)


def test_an_unreachable_host_is_refused() -> None:
    limits = ImageLimits(allowed_domains=frozenset({"127.0.0.1"}), fetch_timeout_s=2)
    with socket_port() as port:  # a port nobody listens on
        assert "could not be fetched" in _refused(image_from_url, f"http://127.0.0.1:{port}/a.png", PART, limits)


class socket_port:
    """A free local port, bound but not listening while the block runs, so connections to it are refused."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


# --- properties ---------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_png_round_trip_keeps_pixels_and_digest(height: int, width: int, seed: int) -> None:
    pixels = _rgb(height, width, seed)
    decoded = image_from_bytes(_encode(Image.fromarray(pixels), "PNG"), PART, LIMITS)
    np.testing.assert_array_equal(decoded.pixels, pixels)
    assert decoded.digest == image_from_pil(Image.fromarray(pixels), PART, LIMITS).digest


FUZZ = ImageLimits(max_pixels=64 * 64, max_bytes=4096)
VALID = [_encode(Image.fromarray(_rgb(6, 5)), fmt) for fmt in ("PNG", "JPEG", "GIF", "WEBP")]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([b""] + VALID), st.integers(0, 400), st.lists(st.tuples(st.integers(0, 400),
                                                                              st.integers(0, 255)), max_size=6),
       st.binary(max_size=64))
def test_arbitrary_bytes_raise_nothing_but_image_error(valid: bytes, cut: int, edits: list[tuple[int, int]],
                                                       tail: bytes) -> None:
    data = bytearray(valid[:cut] if valid else tail)
    for at, value in edits:
        if at < len(data):
            data[at] = value
    for call in (lambda: image_from_bytes(bytes(data), PART, FUZZ),
                 lambda: image_from_base64(base64.b64encode(bytes(data)).decode(), None, PART, FUZZ)):
        try:
            image = call()
        except ImageError as error:
            assert error.param == PART
        else:
            assert image.pixels.ndim == 3 and image.pixels.shape[2] == 3


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(max_size=80), st.text(max_size=80).map("data:".__add__),
                 st.text("AB+/=\n ,;", max_size=40).map("data:image/gif;base64,R0lG".__add__)))
def test_arbitrary_urls_raise_nothing_but_image_error(url: str) -> None:
    try:
        image_from_url(url, PART, LIMITS)  # no host is allowed: nothing is ever fetched
    except ImageError as error:
        assert error.param == PART
