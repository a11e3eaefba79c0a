"""The SmolVLM / Idefics3 vision side: a SigLIP-style encoder over square tiles and the connector (pixel shuffle,
then a bias-free projection to the text model's width), giving one embedding per `<image>` token. Module names
follow the checkpoint's (`vision_model.`, `connector.` under `model.`), so its tensors load as they are."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pagegate.engine.errors import ModelLoadError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
_PREFIXES = ("vision_model.", "connector.")


@dataclass(frozen=True)
class Idefics3VisionConfig:
    """The fields of an Idefics3 config.json the vision side reads (transformers' defaults where absent)."""

    text_hidden_size: int
    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    scale_factor: int = 2

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Idefics3VisionConfig:
        """From the whole config.json dict (vision_config, text_config's hidden_size, scale_factor)."""
        vision = config.get("vision_config", {})
        names = cls.__dataclass_fields__
        made = cls(text_hidden_size=config.get("text_config", {}).get("hidden_size", 4096),
                   scale_factor=config.get("scale_factor", 2),
                   **{key: value for key, value in vision.items() if key in names and key != "text_hidden_size"})
        if made.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {made.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        if made.patches_per_side % made.scale_factor:
            raise ModelLoadError(f"{made.patches_per_side} patches per side do not shuffle by {made.scale_factor}")
        return made

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def image_seq_len(self) -> int:
        """Image tokens per tile: the patch grid shrunk by the scale factor in each direction."""
        return (self.patches_per_side // self.scale_factor) ** 2


def tile_position_ids(patches_per_side: int) -> torch.Tensor:
    """The position-embedding row of each patch of a full tile, [P * P], computed as transformers does."""
    # NOTE: transformers buckets each patch's fractional coordinate i * (1 / P) (float32) against the boundaries
    # arange(1 / P, 1, 1 / P); rounding makes that differ from i for some P (19, 25, ...: a row reuses its
    # neighbour's embedding), so the arithmetic is repeated here rather than assumed to be arange(P * P).
    count = patches_per_side
    boundaries = torch.arange(1 / count, 1.0, 1 / count, dtype=torch.float32)
    step = 1.0 / torch.tensor([count])
    coords = torch.clamp(torch.arange(count, dtype=torch.float32) * step, max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)
    return (buckets[:, None] * count + buckets[None, :]).reshape(-1)


class Embeddings(nn.Module):
    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)
        self.register_buffer("position_ids", tile_position_ids(config.patches_per_side), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, P * P, hidden], patches row-major."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding(self.position_ids)


class Attention(nn.Module):
    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        width = config.hidden_size
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention over one tile's patches: [n, L, hidden] -> [n, L, hidden]."""
        n, length, width = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(n, length, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        return self.out_proj(out.transpose(1, 2).reshape(n, length, width))


class MLP(nn.Module):
    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """Pre-norm: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class VisionTransformer(nn.Module):
    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, P * P, hidden]."""
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class Connector(nn.Module):
    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.scale = config.scale_factor
        shuffled = config.hidden_size * config.scale_factor**2
        self.modality_projection = nn.ModuleDict({"proj": nn.Linear(shuffled, config.text_hidden_size, bias=False)})

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[n, P * P, hidden] -> [n, (P / s)^2, text_hidden]."""
        return self.modality_projection["proj"](pixel_shuffle(patches, self.scale))


def pixel_shuffle(patches: torch.Tensor, scale: int) -> torch.Tensor:
    """Merge each s x s block of the patch grid into one vector: [n, P * P, d] -> [n, (P / s)^2, s * s * d].
    Blocks are row-major over the grid; inside a block the vector is its rows in order, each row's patches in
    order (transformers' view/permute sequence, written as one view and one permute)."""
    n, length, width = patches.shape
    side = int(length**0.5)
    grid = patches.view(n, side // scale, scale, side // scale, scale, width)
    return grid.permute(0, 1, 3, 2, 4, 5).reshape(n, (side // scale) ** 2, scale * scale * width)


class Idefics3Vision(nn.Module):
    """Tiles -> image-token embeddings for the text model.

    Full tiles only: the processor's tiles of one image are never padded (every pixel real), so the
    pixel/patch attention masks transformers supports are not built; every patch attends to every patch."""

    def __init__(self, config: Idefics3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = VisionTransformer(config)
        self.connector = Connector(config)
        self.stored_dtype = torch.float32  # the precision its weights were published in (set by the loaders)
        self.compute_dtype = torch.float32  # its matmuls' (autocast to bfloat16 / float16 where it is not float32)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Idefics3Vision:
        """From the whole config.json dict; weights are uninitialized until load_state_dict_hf."""
        return cls(Idefics3VisionConfig.from_dict(config))

    def load_state_dict_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's `model.vision_model.*` and `model.connector.*` tensors in (other names are ignored);
        a missing, extra or misshapen vision tensor fails."""
        state = {}
        for name, tensor in tensors.items():
            local = name.removeprefix("model.")
            if local.startswith(_PREFIXES):
                state[local] = tensor
        try:
            self.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise ModelLoadError(f"Idefics3 vision weights do not fit the config: {error}") from error

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] tiles -> [n * image_seq_len, text_hidden]: the rows for the image tokens, in prompt order."""
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(f"expected tiles [n, {self.config.num_channels}, {size}, {size}], "
                             f"got {list(pixel_values.shape)}")
        weight = self.vision_model.embeddings.patch_embedding.weight
        with torch.autocast(weight.device.type, self.compute_dtype, enabled=self.compute_dtype != weight.dtype):
            features = self.connector(self.vision_model(pixel_values.to(weight.device, weight.dtype)))
        return features.reshape(-1, features.shape[-1]).to(weight.dtype)


def load_idefics3_vision(folder: Path, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> Idefics3Vision:
    """The vision tower and connector of the checkpoint in `folder` (config.json, *.safetensors), in eval mode."""
    config = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.removeprefix("model.").startswith(_PREFIXES):
                    tensors[name] = reader.get_tensor(name)
    model = Idefics3Vision.from_config(config)
    model.load_state_dict_hf(tensors)
    model.stored_dtype = tensors[next(iter(tensors))].dtype
    return model.to(device=device, dtype=dtype).eval()
