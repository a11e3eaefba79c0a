"""The Gemma 3 vision side: a SigLIP encoder over the one square image and the multimodal projector (the patch grid
average-pooled to mm_tokens_per_image, a Gemma RMSNorm, then a bias-free projection to the text model's width),
giving one embedding per `<image_soft_token>`. The encoder layers are Idefics3's (the same SigLIP blocks); module
names follow the published checkpoint's (`vision_tower.vision_model.`, `multi_modal_projector.`), so its tensors
load as they are.

NOTE: Gemma3ForConditionalGeneration puts these rows in place of the soft tokens' embeddings after the text
embeddings were scaled by sqrt(hidden_size): the rows themselves are not scaled."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.models.idefics3_vision import ACTIVATIONS, Encoder, Idefics3VisionConfig

_PREFIXES = ("vision_tower.vision_model.", "multi_modal_projector.")


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """The fields of a Gemma 3 config.json the vision side reads. Defaults are transformers' (SiglipVisionConfig's,
    Gemma3Config's, Gemma3TextConfig's hidden size): gemma-3-4b-it's config.json leaves many out."""

    text_hidden_size: int = 2304
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    mm_tokens_per_image: int = 256

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Gemma3VisionConfig:
        """From the whole config.json dict (vision_config, text_config's hidden_size, mm_tokens_per_image)."""
        vision = config.get("vision_config", {})
        names = cls.__dataclass_fields__
        made = cls(text_hidden_size=config.get("text_config", {}).get("hidden_size", 2304),
                   mm_tokens_per_image=config.get("mm_tokens_per_image", 256),
                   **{key: value for key, value in vision.items()
                      if key in names and key not in ("text_hidden_size", "mm_tokens_per_image")})
        if made.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {made.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        side = made.tokens_per_side
        if side * side != made.mm_tokens_per_image or made.patches_per_side % side:
            raise ModelLoadError(f"{made.patches_per_side} x {made.patches_per_side} patches do not pool evenly to "
                                 f"{made.mm_tokens_per_image} image tokens")
        return made

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return int(self.mm_tokens_per_image**0.5)

    @property
    def image_seq_len(self) -> int:
        """Image tokens per image: the pooled grid."""
        return self.mm_tokens_per_image

    @property
    def tower(self) -> Idefics3VisionConfig:
        """The shape of the SigLIP encoder layers, as the shared Encoder takes it."""
        return Idefics3VisionConfig(text_hidden_size=self.text_hidden_size, hidden_size=self.hidden_size,
                                    intermediate_size=self.intermediate_size,
                                    num_hidden_layers=self.num_hidden_layers,
                                    num_attention_heads=self.num_attention_heads, num_channels=self.num_channels,
                                    image_size=self.image_size, patch_size=self.patch_size,
                                    layer_norm_eps=self.layer_norm_eps, hidden_act=self.hidden_act)


class Embeddings(nn.Module):
    """Patches plus a learned embedding per patch position (SigLIP's: positions 0 .. P * P - 1 in row-major
    order, not Idefics3's bucketed ones)."""

    def __init__(self, config: Gemma3VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, P * P, hidden]."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class VisionTransformer(nn.Module):
    def __init__(self, config: Gemma3VisionConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config.tower)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, P * P, hidden]."""
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class VisionTower(nn.Module):
    """transformers' SiglipVisionModel as the published checkpoint names it: the transformer under `vision_model`."""

    def __init__(self, config: Gemma3VisionConfig) -> None:
        super().__init__()
        self.vision_model = VisionTransformer(config)


class RMSNorm(nn.Module):
    """Gemma's: computed in float32, scaled by (1 + weight)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = x.float()
        values = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps)
        return (values * (1.0 + self.weight.float())).type_as(x)


class Projector(nn.Module):
    def __init__(self, config: Gemma3VisionConfig) -> None:
        super().__init__()
        self.side = config.patches_per_side
        self.kernel = config.patches_per_side // config.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(config.hidden_size, config.text_hidden_size))
        self.mm_soft_emb_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[n, P * P, hidden] -> [n, T, text_hidden]: each k x k block of the patch grid averaged (blocks
        row-major), normalized, projected."""
        n, _, width = patches.shape
        grid = patches.transpose(1, 2).reshape(n, width, self.side, self.side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3Vision(nn.Module):
    """Images (each one tile of the tower's size) -> image-token embeddings for the text model."""

    def __init__(self, config: Gemma3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config)
        self.multi_modal_projector = Projector(config)
        self.stored_dtype = torch.float32  # the precision its weights were published in (set by the loader)
        self.compute_dtype = torch.float32  # its matmuls' (autocast to bfloat16 / float16 where it is not float32)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Gemma3Vision:
        """From the whole config.json dict; weights are uninitialized until load_state_dict_hf."""
        return cls(Gemma3VisionConfig.from_dict(config))

    def load_state_dict_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's vision tower and projector tensors in, named as the published checkpoint names them
        or as transformers 5 saves them (other names are ignored); a missing, extra or misshapen one fails."""
        state = {}
        for name, tensor in tensors.items():
            local = checkpoint_name(name)
            if local is not None:
                state[local] = tensor
        try:
            self.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise ModelLoadError(f"Gemma 3 vision weights do not fit the config: {error}") from error

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] images -> [n * image_seq_len, text_hidden]: the rows for the soft tokens, in prompt order."""
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(f"expected images [n, {self.config.num_channels}, {size}, {size}], "
                             f"got {list(pixel_values.shape)}")
        tower = self.vision_tower.vision_model
        weight = tower.embeddings.patch_embedding.weight
        with torch.autocast(weight.device.type, self.compute_dtype, enabled=self.compute_dtype != weight.dtype):
            features = self.multi_modal_projector(tower(pixel_values.to(weight.device, weight.dtype)))
        return features.reshape(-1, features.shape[-1]).to(weight.dtype)


def checkpoint_name(name: str) -> str | None:
    """A checkpoint tensor's name in Gemma3Vision, None for one it does not hold. Published Gemma 3 files name the
    tower `vision_tower.vision_model.*`; transformers 5 saves `vision_tower.*` (its SiglipVisionModel lost that
    level) and, in memory, puts everything under `model.`."""
    local = name.removeprefix("model.")
    if local.startswith("vision_tower.") and not local.startswith("vision_tower.vision_model."):
        local = "vision_tower.vision_model." + local.removeprefix("vision_tower.")
    if not local.startswith(_PREFIXES) or re.match(r"vision_tower\.vision_model\.head\.", local):
        return None  # NOTE: a SigLIP pooling head, where a file has one, is not part of Gemma 3's image features
    return local


def load_gemma3_vision(folder: Path, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> Gemma3Vision:
    """The vision tower and projector of the checkpoint in `folder` (config.json, *.safetensors), in eval mode."""
    config = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                if checkpoint_name(name) is not None:
                    tensors[name] = reader.get_tensor(name)
    if not tensors:
        raise ModelLoadError(f"{folder} holds no Gemma 3 vision tensors (vision_tower.*, multi_modal_projector.*)")
    model = Gemma3Vision.from_config(config)
    model.load_state_dict_hf(tensors)
    model.stored_dtype = tensors[next(iter(tensors))].dtype
    return model.to(device=device, dtype=dtype).eval()
