"""A prompt chunk of a model that reads images bidirectionally (Gemma 3) never ends inside an image: an image's tokens
are computed in one step, all of them seeing each other (tests/engine/models/test_image_attention.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagegate.engine.scheduler import _whole_images


@pytest.mark.parametrize(("start", "n", "allowance", "chunk"), [
    (0, 8, 8, 8),  # ends before the first image
    (0, 15, 15, 10),  # would end inside [10, 30): back to its start
    (0, 30, 30, 30), (0, 34, 40, 34),  # the image whole, or whole and more
    (10, 8, 8, 0), (10, 8, 20, 20),  # starts at the image: whole if the allowance holds it, else not this step
    (16, 4, 4, 0), (16, 4, 14, 14),  # a prefix hit ended inside it (or the hit's cut shortened n): the same
    (30, 8, 8, 8), (32, 12, 12, 12),  # past it; a second image [40, 44) whole in 12
    (32, 10, 10, 8),  # ...and cut back to its start in 10
])
def test_a_chunk_never_ends_inside_an_image(start: int, n: int, allowance: int, chunk: int) -> None:
    images = [SimpleNamespace(start=10, end=30), SimpleNamespace(start=40, end=44)]
    seq = SimpleNamespace(request=SimpleNamespace(images=images))
    assert _whole_images(seq, start, n, allowance) == chunk  # type: ignore[arg-type]
