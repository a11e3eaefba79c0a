"""Random PEFT LoRA adapters for tests and benchmarks (peft initialises B to zero, which would change nothing)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any


def save_random_adapter(base: Any, folder: Path, config: Any, seed: int, scale: float) -> Any:
    """A PEFT LoRA (`config`, a peft.LoraConfig) over a copy of `base` whose every A and B is `scale` times a
    seeded standard normal, saved into `folder`; the peft model, in eval mode."""
    import peft
    import torch

    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=gen))
    model.eval()
    model.save_pretrained(str(folder))
    return model
