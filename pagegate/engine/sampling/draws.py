"""A random stream for sampling that is torch's CPU generator without importing torch.

The C sampler takes one uniform number a sampled row, which the torch sampler drew with `torch.rand(1, generator=g)`:
on the CPU that is the next 32-bit output of a Mersenne Twister seeded with the seed's low 32 bits, its low 24
bits times 2^-24. numpy's MT19937 with the legacy seeding is that twister, so `Draws` gives the very numbers, and a
seeded request samples the same tokens in an engine core that never imports torch (the lean one, issue 57) as in
one that does. Where a row needs torch's sampler (penalties, a grammar, a bias) `torch_generator()` hands over a
torch generator at the same point of the stream, and every later draw comes from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

_LOW_24 = (1 << 24) - 1
_MASK32 = (1 << 32) - 1


class Draws:
    """The random stream of a seed on `device` (a torch generator from the start on any device but the CPU)."""

    def __init__(self, seed: int, device: str | torch.device = "cpu") -> None:
        self.seed = seed
        self.device = str(device)
        self.drawn = 0  # uniforms drawn from the twister
        self._torch: torch.Generator | None = None
        self._twister = np.random.MT19937()
        self._twister._legacy_seeding(seed & _MASK32)
        if self.device != "cpu":
            self.torch_generator()

    def uniform(self) -> float:
        """The next uniform number in [0, 1), as torch.rand(1, generator=...) gives it."""
        if self._torch is not None:
            import torch
            return float(torch.rand(1, generator=self._torch))
        self.drawn += 1
        return (int(self._twister.random_raw()) & _LOW_24) * 2.0**-24

    def torch_generator(self) -> torch.Generator:
        """The stream as a torch generator, where the twister has got to; this object draws from it from now on."""
        if self._torch is None:
            import torch
            self._torch = torch.Generator(device=self.device).manual_seed(self.seed)
            for _ in range(self.drawn):  # one 32-bit output each, as uniform() took them
                torch.rand(1, generator=self._torch)
        return self._torch
