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


def lora_tensors(shapes: dict[str, tuple[int, int]], layers: int, rank: int, seed: int,
                 scale: float) -> dict[str, Any]:
    """PEFT's tensors of a rank-`rank` LoRA on `shapes` ({"q_proj": (in, out), ...}; "q_proj", "k_proj", "v_proj",
    "o_proj" are self_attn's, the rest mlp's) of every layer: `scale` times a seeded standard normal, float32."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module, (inputs, outputs) in shapes.items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (scale * rng.standard_normal((rank, inputs))).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (scale * rng.standard_normal((outputs, rank))).astype(np.float32)
    return tensors


def write_adapter(folder: Path, tensors: dict[str, Any], config: Any = None, config_text: str | None = None) -> Path:
    """A PEFT folder written by hand: `tensors` (numpy arrays, any dtype) into adapter_model.safetensors and
    `config` as adapter_config.json (`config_text`: that file's exact text, for configs JSON cannot write)."""
    import json

    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    text = config_text if config_text is not None else json.dumps(config)
    (folder / "adapter_config.json").write_text(text)
    return folder
