"""Each vision family's image preprocessing behind one name: what the runner builds from a checkpoint, what the
gateway expands placeholders with, and what crosses the seam between them. Torch-free."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

from pagegate.engine.media.gemma3 import Gemma3Processing
from pagegate.engine.media.idefics3 import Idefics3Processing

ImageProcessing = Idefics3Processing | Gemma3Processing
FAMILIES: dict[str, type[Idefics3Processing] | type[Gemma3Processing]] = {"idefics3": Idefics3Processing,
                                                                            "gemma3": Gemma3Processing}


def processing_from_folder(family: str, folder: Path) -> ImageProcessing:
    """The preprocessing of the `family` checkpoint in `folder` (ModelConfig.vision names the family)."""
    return FAMILIES[family].from_folder(folder)


class WireProcessing(msgspec.Struct, array_like=True):
    """An image preprocessing as a frame carries it: its family and its settings."""

    family: str
    settings: dict[str, Any]

    @classmethod
    def of(cls, processing: ImageProcessing) -> WireProcessing:
        family = next(name for name, kind in FAMILIES.items() if isinstance(processing, kind))
        return cls(family, asdict(processing))

    def processing(self) -> ImageProcessing:
        return msgspec.convert(self.settings, FAMILIES[self.family])
