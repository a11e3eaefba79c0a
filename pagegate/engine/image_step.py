"""The image encoder at step time: each image's rows are computed once (kept by content hash, within a byte bound,
least recently used out first) and put in place of its placeholder tokens' embeddings in the steps that hold them."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import torch

from pagegate.engine.media.prompt_images import ImageInput, VisionSpec
from pagegate.engine.sequence import Sequence

Given = tuple[np.ndarray, torch.Tensor]  # (step tokens int32 [R], rows float32 [R, hidden])


def encoder_dtype(stored: torch.dtype, device: torch.device) -> torch.dtype:
    """The precision the image encoder's matmuls run in: float32 for float32 weights (the reference's arithmetic);
    for weights published in half precision, that precision on CUDA, and bfloat16 on a CPU that computes it natively
    (AVX-512 BF16 or AMX: 3.3x the float32 speed of a SigLIP tower on 2 Zen 4 cores), float32 elsewhere."""
    if stored == torch.float32:
        return torch.float32
    if device.type == "cuda":
        return stored
    return torch.bfloat16 if _native_bf16() else torch.float32


@functools.cache
def _native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


class ImageRows:
    """The encoder's rows of the images in a step; `normalize`: uint8 tiles [n, S, S, 3] -> the encoder's float32
    input [n, 3, S, S]; `encode`: that input -> rows [R, hidden]."""

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], spec: VisionSpec, max_bytes: int,
                 normalize: Callable[[np.ndarray], np.ndarray]) -> None:
        self.encode = encode
        self.normalize = normalize
        self.spec = spec  # what intake checks of an image (the tiles the encoder takes, the rows it gives)
        self.max_bytes = max_bytes
        self.cached: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0
        self.encoded = 0  # images run through the encoder (a hit in the cache runs none)

    def rows(self, image: ImageInput) -> torch.Tensor:
        """The image's rows [len(image.rows), hidden]: from the cache, or encoded now (and kept if they fit)."""
        rows = self.cached.get(image.digest)
        if rows is not None:
            self.cached.move_to_end(image.digest)
            return rows
        rows = self.encode(torch.from_numpy(self.normalize(image.tiles))).float().contiguous()
        self.encoded += 1
        if rows.shape[0] != len(image.rows):
            raise ValueError(f"the image encoder gave {rows.shape[0]} rows for an image of {len(image.rows)} tokens")
        size = rows.numel() * rows.element_size()
        if size <= self.max_bytes:
            while self.cached_bytes + size > self.max_bytes:
                _, old = self.cached.popitem(last=False)
                self.cached_bytes -= old.numel() * old.element_size()
            self.cached[image.digest] = rows
            self.cached_bytes += size
        return rows

    def key_ends(self, seqs: Seq[Sequence], counts: Seq[int], starts: np.ndarray,
                 positions: np.ndarray) -> np.ndarray | None:
        """The last position each of the step's tokens attends to: its own, and for the tokens of an image the model
        reads bidirectionally the image's last (the scheduler computes an image to its end in one step). None: the
        model reads images causally, or the step holds no image token."""
        if not self.spec.bidirectional:
            return None
        ends = None
        for i, begin, image in _step_images(seqs, counts):
            ends = positions.copy() if ends is None else ends
            first = max(image.start, begin)
            ends[starts[i] + first - begin:starts[i] + image.end - begin] = image.end - 1
        return ends

    def given(self, seqs: Seq[Sequence], counts: Seq[int], starts: np.ndarray) -> Given | None:
        """The step's image rows: for each sequence's known tokens in the step (its chunk, before any guessed
        tokens), the rows of the image positions among them, at their places in the step. None: no image token."""
        tokens: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        step: dict[bytes, torch.Tensor] = {}  # an image too large for the cache is still encoded once a step
        for i, begin, image in _step_images(seqs, counts):
            inside = (image.rows >= begin) & (image.rows < seqs[i].num_computed)
            tokens.append((image.rows[inside] - begin + starts[i]).astype(np.int32))
            if image.digest not in step:
                step[image.digest] = self.rows(image)
            rows.append(step[image.digest][torch.from_numpy(inside)])
        if not tokens:
            return None
        return np.concatenate(tokens), torch.cat(rows).contiguous()


def _step_images(seqs: Seq[Sequence], counts: Seq[int]) -> Iterator[tuple[int, int, ImageInput]]:
    """(i, begin, image) for each image of sequence i that its known tokens in the step (from position `begin` to
    its num_computed, before any guessed tokens) reach."""
    for i, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
        end = seq.num_computed
        begin = end - n + len(seq.draft)
        for image in seq.request.images:
            if image.start < end and image.end > begin:
                yield i, begin, image
