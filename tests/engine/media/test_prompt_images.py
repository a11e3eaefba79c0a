"""What the prefix cache calls a prompt's image tokens (prefix_keys), where each image's rows sit (image_rows) and what
intake checks of an image (VisionSpec): properties over random prompts of text and images, every refusal."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.media.prompt_images import KEY_BIT, ImageInput, VisionSpec, image_rows, prefix_keys

IMAGE = 7  # the image token of these prompts
MARKER = 5  # a marker between an image's tiles (a real token inside its span, as Idefics3's row tokens are)
TEXT = st.integers(0, 50_000).filter(lambda t: t != IMAGE)
SPEC = VisionSpec(image_token_id=IMAGE, tile_size=4, rows_per_tile=3)
PROPERTY = settings(max_examples=80, deadline=None)
NO_TILES = np.zeros((0, 3, 1, 1), dtype=np.float32)  # prefix_keys reads the rows and the digest alone


@dataclass
class Prompt:
    tokens: list[int]
    images: list[ImageInput]
    block_size: int

    def keyed(self, image: int) -> range:
        """The positions image `image`'s words replace: from the start of the page of its first row (or the end of
        the image before it, when that lies inside that page) to its last row."""
        first = self.images[image]
        start = first.start - first.start % self.block_size
        if image:
            start = max(start, self.images[image - 1].end)
        return range(start, first.end)

    def with_digests(self, digests: list[bytes]) -> list[ImageInput]:
        return [ImageInput(image.rows, digest, image.tiles) for image, digest in zip(self.images, digests, strict=True)]


def _digest(draw: st.DrawFn) -> bytes:
    return draw(st.binary(min_size=32, max_size=32))


@st.composite
def prompts(draw: st.DrawFn, max_images: int = 3, min_images: int = 0) -> Prompt:
    """Text runs and images: an image is one or more runs of image tokens with a marker between them."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    tokens: list[int] = draw(st.lists(TEXT, max_size=40))
    images = []
    for _ in range(draw(st.integers(min_images, max_images))):
        rows: list[int] = []
        for tile in range(draw(st.integers(1, 3))):
            if tile:
                tokens.append(MARKER)
            count = draw(st.integers(1, 6))
            rows += range(len(tokens), len(tokens) + count)
            tokens += [IMAGE] * count
        images.append(ImageInput(np.asarray(rows, dtype=np.int32), _digest(draw), NO_TILES))
        tokens += draw(st.lists(TEXT, max_size=20))
    return Prompt(tokens, images, block_size)


def _keyed_positions(prompt: Prompt) -> set[int]:
    return {p for i in range(len(prompt.images)) for p in prompt.keyed(i)}


# --- prefix_keys -------------------------------------------------------------------------------------------------

@PROPERTY
@given(prompts(max_images=0))
def test_a_text_only_prompt_is_its_own_keys(prompt: Prompt) -> None:
    assert prefix_keys(prompt.tokens, [], prompt.block_size) == prompt.tokens


@PROPERTY
@given(prompts(min_images=1))
def test_keys_are_tokens_outside_the_image_ranges_and_negative_words_inside(prompt: Prompt) -> None:
    keys = prefix_keys(prompt.tokens, prompt.images, prompt.block_size)
    assert len(keys) == len(prompt.tokens)
    keyed = _keyed_positions(prompt)
    for position, (key, token) in enumerate(zip(keys, prompt.tokens, strict=True)):
        if position in keyed:
            assert -2**31 <= key < 0, (position, key)  # an int32 with the high bit set: never a token id
            assert key & 0xFFFFFFFF & KEY_BIT
        else:
            assert key == token, position
    # every image row, and every position of the page before an image's first row, is keyed
    for image in prompt.images:
        page = image.start - image.start % prompt.block_size
        assert set(range(page, image.end)) <= keyed


@PROPERTY
@given(prompts(min_images=1), st.data())
def test_another_digest_changes_every_key_of_its_range(prompt: Prompt, data: st.DataObject) -> None:
    keys = prefix_keys(prompt.tokens, prompt.images, prompt.block_size)
    which = data.draw(st.integers(0, len(prompt.images) - 1))
    digests = [image.digest for image in prompt.images]
    other = data.draw(st.binary(min_size=32, max_size=32).filter(lambda d: d != digests[which]))
    digests[which] = other
    changed = prefix_keys(prompt.tokens, prompt.with_digests(digests), prompt.block_size)
    moved = prompt.keyed(which)
    for position in range(len(keys)):
        # 31 bits a word: an equal word by chance has odds of about len(moved) / 2^31
        assert (changed[position] != keys[position]) == (position in moved), position


@PROPERTY
@given(prompts(min_images=1))
def test_the_same_digests_and_tokens_give_the_same_keys(prompt: Prompt) -> None:
    keys = prefix_keys(prompt.tokens, prompt.images, prompt.block_size)
    copies = [ImageInput(image.rows.copy(), bytes(image.digest), NO_TILES) for image in prompt.images]
    assert prefix_keys(list(prompt.tokens), copies, prompt.block_size) == keys
    # and they are words of the SHAKE-256 stream of the documented record, not of anything else
    image = prompt.images[0]
    begin = prompt.keyed(0).start
    record = b"".join((b"pagegate-image-keys-v1\0", (32).to_bytes(4, "little"), image.digest,
                       begin.to_bytes(8, "little"), (image.end - begin).to_bytes(4, "little"),
                       np.asarray(prompt.tokens[begin:image.end], dtype="<u4").tobytes()))
    words = np.frombuffer(hashlib.shake_256(record).digest(4 * (image.end - begin)), dtype="<u4") | KEY_BIT
    assert keys[begin:image.end] == words.view("<i4").tolist()


@PROPERTY
@given(prompts(min_images=1, max_images=1), st.data())
def test_a_text_token_before_the_image_in_its_first_page_changes_the_whole_range(prompt: Prompt,
                                                                               data: st.DataObject) -> None:
    image = prompt.images[0]
    page = image.start - image.start % prompt.block_size
    keys = prefix_keys(prompt.tokens, prompt.images, prompt.block_size)
    if page < image.start:
        position = data.draw(st.integers(page, image.start - 1))
        tokens = list(prompt.tokens)
        tokens[position] = data.draw(TEXT.filter(lambda t: t != prompt.tokens[position]))
        changed = prefix_keys(tokens, prompt.images, prompt.block_size)
        assert all(changed[p] != keys[p] for p in range(page, image.end))
        assert changed[image.end:] == keys[image.end:]
    if page:  # a token of an earlier page is only itself: that page's hash chains into the image's
        position = data.draw(st.integers(0, page - 1))
        tokens = list(prompt.tokens)
        tokens[position] = data.draw(TEXT.filter(lambda t: t != prompt.tokens[position]))
        changed = prefix_keys(tokens, prompt.images, prompt.block_size)
        assert [p for p in range(len(keys)) if changed[p] != keys[p]] == [position]


def test_two_images_in_one_page() -> None:
    """The second image's range starts where the first ends; the page commits to both digests."""
    tokens = [1, 2, IMAGE, IMAGE, 3, IMAGE, IMAGE, IMAGE, 4, 5]
    first = ImageInput(np.array([2, 3], dtype=np.int32), b"a" * 32, NO_TILES)
    second = ImageInput(np.array([5, 6, 7], dtype=np.int32), b"b" * 32, NO_TILES)
    keys = prefix_keys(tokens, [first, second], block_size=16)
    assert all(k < 0 for k in keys[:8]) and keys[8:] == [4, 5]
    other_first = prefix_keys(tokens, [ImageInput(first.rows, b"c" * 32, NO_TILES), second], 16)
    assert all(a != b for a, b in zip(other_first[:4], keys[:4], strict=True)) and other_first[4:] == keys[4:]
    other_second = prefix_keys(tokens, [first, ImageInput(second.rows, b"c" * 32, NO_TILES)], 16)
    assert other_second[:4] == keys[:4] and all(a != b for a, b in zip(other_second[4:8], keys[4:8], strict=True))
    swapped = prefix_keys(tokens, [ImageInput(first.rows, second.digest, NO_TILES),
                                   ImageInput(second.rows, first.digest, NO_TILES)], 16)
    assert all(a != b for a, b in zip(swapped[:8], keys[:8], strict=True))


# --- image_rows and VisionSpec -----------------------------------------------------------------------------------

@PROPERTY
@given(prompts())
def test_image_rows_are_the_image_tokens_in_order(prompt: Prompt) -> None:
    counts = [len(image.rows) for image in prompt.images]
    rows = image_rows(prompt.tokens, IMAGE, counts)
    assert len(rows) == len(counts)
    for found, image in zip(rows, prompt.images, strict=True):
        assert found.dtype == np.int32
        np.testing.assert_array_equal(found, image.rows)


@PROPERTY
@given(prompts(), st.lists(st.integers(0, 8), max_size=4))
def test_image_rows_refuses_counts_that_miss_the_image_tokens(prompt: Prompt, counts: list[int]) -> None:
    held = prompt.tokens.count(IMAGE)
    if sum(counts) == held:
        counts = [*counts, 1]
    with pytest.raises(ValueError, match=f"holds {held} image tokens"):
        image_rows(prompt.tokens, IMAGE, counts)


def _tiles(n: int, size: int = SPEC.tile_size, dtype: type = np.uint8) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, size, size, 3)).astype(dtype)


@PROPERTY
@given(st.lists(st.tuples(st.lists(TEXT, max_size=20), st.integers(1, 2), st.binary(min_size=32, max_size=32)),
                max_size=3), st.lists(TEXT, max_size=10), st.sampled_from([1, 4, 16]))
def test_inputs_place_each_image_on_its_rows_and_key_it(parts: list[tuple[list[int], int, bytes]], tail: list[int],
                                                        block_size: int) -> None:
    tokens: list[int] = []
    images: list[tuple[bytes, np.ndarray]] = []
    for text, n, digest in parts:  # text, then an image of n tiles between two markers
        tokens += [*text, MARKER, *[IMAGE] * (n * SPEC.rows_per_tile), MARKER]
        images.append((digest, _tiles(n)))
    tokens += tail
    placed, keys = SPEC.inputs(tokens, images, block_size)
    if not images:
        assert placed == () and keys is None
        return
    assert [p for image in placed for p in image.rows.tolist()] == [p for p, t in enumerate(tokens) if t == IMAGE]
    for image, (digest, tiles) in zip(placed, images, strict=True):
        assert image.digest == digest and image.tiles is tiles
        assert len(image.rows) == len(tiles) * SPEC.rows_per_tile
    assert keys == prefix_keys(tokens, placed, block_size)


def test_inputs_refuse_images_that_miss_the_image_tokens() -> None:
    tokens = [1, *[IMAGE] * 3, 2]
    with pytest.raises(InvalidParamError, match="holds 3 image tokens") as caught:
        SPEC.inputs(tokens, [(b"d" * 32, _tiles(2))], 16)  # 2 tiles: 6 rows
    assert caught.value.param == "prompt"
    with pytest.raises(InvalidParamError) as caught:
        SPEC.inputs(tokens, [], 16)  # image tokens written as text, no image
    assert caught.value.param == "prompt"
    with pytest.raises(InvalidParamError, match="32-byte") as caught:
        SPEC.inputs(tokens, [(b"d" * 32, _tiles(1)), (b"short", _tiles(1))], 16)
    assert caught.value.param == "images.1"


@pytest.mark.parametrize("tiles", [
    _tiles(1, dtype=np.float32),
    _tiles(1, dtype=np.int16),
    _tiles(1, size=SPEC.tile_size + 1),
    _tiles(1)[..., :2],
    _tiles(1)[0],
    _tiles(0),
    np.zeros((1, 3, SPEC.tile_size, SPEC.tile_size), dtype=np.uint8),
], ids=["float32", "int16", "size", "channels", "three_dims", "no_tiles", "channels_first"])
def test_check_tiles_refuses_a_wrong_layout(tiles: np.ndarray) -> None:
    with pytest.raises(InvalidParamError, match="uint8") as caught:
        SPEC.check_tiles(tiles, "images.3")
    assert caught.value.param == "images.3"
    with pytest.raises(InvalidParamError) as caught:
        SPEC.inputs([IMAGE] * SPEC.rows_per_tile, [(b"d" * 32, tiles)], 16)
    assert caught.value.param == "images.0"


def test_check_tiles_takes_any_pixels_of_the_layout() -> None:
    SPEC.check_tiles(_tiles(2), "fine")
    SPEC.check_tiles(np.full((1, SPEC.tile_size, SPEC.tile_size, 3), 255, dtype=np.uint8), "white")
