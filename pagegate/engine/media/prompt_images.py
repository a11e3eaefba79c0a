"""Where a prompt's images sit, and what the prefix cache calls their tokens.

An image enters a prompt as a run of placeholder tokens (the model's image token, with the family's markers between
tiles); the runner puts the image encoder's rows in place of their embeddings. The placeholders are the same for
every image of a size, so the prefix cache must not see them: `prefix_keys` gives the core, in their place, words
derived from the image's content hash (vLLM keys its blocks by the multimodal hash the same way)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagegate.engine.errors import InvalidParamError

KEY_RECORD = b"pagegate-image-keys-v1\0"
KEY_BIT = 0x80000000  # set in every derived key: no token id of a vocabulary has it, so a key never equals one


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: its encoder input and the prompt positions its rows go to.

    `rows`: the positions (ascending) that hold the model's image token, one per row of the encoder's output;
    `digest`: the decoded pixels' SHA-256 (media/images.py), the image's identity in the prefix cache and in the
    encoder-output cache; `tiles`: uint8 [n, size, size, 3], as the family's processor cut them."""

    rows: np.ndarray
    digest: bytes
    tiles: np.ndarray

    @property
    def start(self) -> int:
        return int(self.rows[0])

    @property
    def end(self) -> int:
        return int(self.rows[-1]) + 1


@dataclass(frozen=True)
class VisionSpec:
    """What the engine checks of a prompt's images: the placeholder token, the tile size its encoder takes and the
    rows it gives per tile; `bidirectional`: an image's tokens see each other (Gemma 3), so a step that computes
    any of them computes them all the way to the image's end (scheduler.py, image_step.key_ends)."""

    image_token_id: int
    tile_size: int
    rows_per_tile: int
    bidirectional: bool = False

    def check_tiles(self, tiles: np.ndarray, param: str) -> None:
        """InvalidParamError unless `tiles` is uint8 [n >= 1, tile_size, tile_size, 3]."""
        size = self.tile_size
        if tiles.dtype != np.uint8 or tiles.ndim != 4 or tiles.shape[1:] != (size, size, 3) or not len(tiles):
            raise InvalidParamError(f"an image's tiles must be uint8 [n, {size}, {size}, 3], not {tiles.dtype} "
                                    f"{list(tiles.shape)}", param)

    def inputs(self, token_ids: Sequence[int], images: Sequence[tuple[bytes, np.ndarray]],
               block_size: int) -> tuple[tuple[ImageInput, ...], list[int] | None]:
        """The prompt's (digest, tiles) images placed on its image tokens, and its prefix keys (None: no image).
        InvalidParamError when the images and the prompt's image tokens do not match."""
        for i, (digest, tiles) in enumerate(images):
            self.check_tiles(tiles, f"images.{i}")
            if len(digest) != 32:
                raise InvalidParamError("an image's digest is its 32-byte SHA-256", f"images.{i}")
        try:
            rows = image_rows(token_ids, self.image_token_id, [len(tiles) * self.rows_per_tile for _, tiles in images])
        except ValueError as error:
            raise InvalidParamError(str(error), "prompt") from None
        inputs = tuple(ImageInput(r, digest, tiles) for r, (digest, tiles) in zip(rows, images, strict=True))
        return inputs, prefix_keys(token_ids, inputs, block_size) if inputs else None


def image_rows(token_ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> list[np.ndarray]:
    """The positions of each image's rows: the image tokens of the prompt, in order, `counts[i]` for image i.
    ValueError when the prompt holds another number of image tokens."""
    positions = np.flatnonzero(np.asarray(token_ids, dtype=np.int64) == image_token_id).astype(np.int32)
    if len(positions) != sum(counts):
        raise ValueError(f"the prompt holds {len(positions)} image tokens, but its {len(counts)} image(s) fill "
                         f"{sum(counts)}")
    ends = np.cumsum(counts)
    return [positions[end - count:end] for count, end in zip(counts, ends, strict=True)]


def prefix_keys(token_ids: Sequence[int], images: Sequence[ImageInput], block_size: int) -> list[int]:
    """The prompt's tokens as the prefix cache sees them: each image's span, and the tokens before it in the page
    where it starts, replaced by words of a SHAKE-256 stream over the image's digest and those tokens.

    NOTE: a page holding an image's first tokens must commit to the whole image, not to the few words of it that
    fall in the page (31 bits a token: one token would be a 2^31 search away from another image's page). Re-keying
    the page's earlier tokens too gives every such page 31 bits of the digest per token it holds."""
    keys = list(token_ids)
    done = 0
    for image in images:
        begin = max(image.start - image.start % block_size, done)
        record = b"".join((KEY_RECORD, struct.pack("<I", len(image.digest)), image.digest,
                           struct.pack("<QI", begin, image.end - begin),
                           np.asarray(token_ids[begin:image.end], dtype="<u4").tobytes()))
        words = np.frombuffer(hashlib.shake_256(record).digest(4 * (image.end - begin)), dtype="<u4") | KEY_BIT
        keys[begin:image.end] = words.view("<i4").tolist()
        done = image.end
    return keys
