"""Each vision family's image preprocessing behind one name: what the runner builds from a checkpoint, what the
gateway expands placeholders with, and what crosses the seam between them. Torch-free; the families (numpy) are
imported when one is built, so a gateway serving a text model never imports them."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec

if TYPE_CHECKING:
    from pagegate.engine.media.gemma3 import Gemma3Processing
    from pagegate.engine.media.idefics3 import Idefics3Processing

ImageProcessing: TypeAlias = "Idefics3Processing | Gemma3Processing"


def families() -> dict[str, type[Idefics3Processing] | type[Gemma3Processing]]:
    from pagegate.engine.media.gemma3 import Gemma3Processing
    from pagegate.engine.media.idefics3 import Idefics3Processing

    return {"idefics3": Idefics3Processing, "gemma3": Gemma3Processing}


def processing_from_folder(family: str, folder: Path) -> ImageProcessing:
    """The preprocessing of the `family` checkpoint in `folder` (ModelConfig.vision names the family)."""
    return families()[family].from_folder(folder)


class WireProcessing(msgspec.Struct, array_like=True):
    """An image preprocessing as a frame carries it: its family and its settings."""

    family: str
    settings: dict[str, Any]

    @classmethod
    def of(cls, processing: ImageProcessing) -> WireProcessing:
        family = next(name for name, kind in families().items() if isinstance(processing, kind))
        return cls(family, asdict(processing))

    def processing(self) -> ImageProcessing:
        return msgspec.convert(self.settings, families()[self.family])
