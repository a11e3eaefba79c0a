"""Read a multimodal projector GGUF (an "mmproj" file, as llama.cpp's `convert_hf_to_gguf.py --mmproj` writes it) for
SmolVLM / Idefics3 or Gemma 3: the vision tower and projector with the Hugging Face module names, and the image
preprocessing its `clip.*` metadata describes. The text model is an ordinary GGUF beside it (gguf_loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.gguf_file import tensor_array
from pagegate.engine.loading.gguf_reader import GGUFContents, GGUFTensor
from pagegate.engine.loading.gguf_types import GGMLQuantizationType
from pagegate.engine.media.gemma3 import Gemma3Processing
from pagegate.engine.media.idefics3 import Idefics3Processing
from pagegate.engine.media.processing import ImageProcessing
from pagegate.engine.models.gemma3_vision import Gemma3Vision
from pagegate.engine.models.idefics3_vision import Idefics3Vision

PROJECTORS = ("idefics3", "gemma3")  # llama.cpp's projector types read here; the family's name is the same
GEMMA3_MERGE = 4  # llama.cpp's default for Gemma 3: the patch grid pooled 4 x 4 (a file may say otherwise)
# NOTE: Idefics3 and SmolVLM resize images so their longest edge is 4 tiles (SmolVLM-256M: 2048 for 512-pixel tiles;
# Idefics3-8B: 1456 for 364). Files written before the converter stored `clip.vision.preproc_image_size` lack it;
# llama.cpp then slices the image at its own size instead, which no transformers checkpoint does, so we assume 4.
TILES_PER_LONGEST_EDGE = 4
_GLOBAL_NAMES = {"v.patch_embd": "vision_model.embeddings.patch_embedding",
                 "v.position_embd": "vision_model.embeddings.position_embedding",
                 "v.post_ln": "vision_model.post_layernorm", "mm.model.fc": "connector.modality_projection.proj",
                 "mm.input_projection": "multi_modal_projector.mm_input_projection",
                 "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm"}
_TOWER = {"idefics3": "", "gemma3": "vision_tower."}  # where each family's SigLIP tower sits
_LAYER_NAMES = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1",
                "ffn_down": "mlp.fc2"}
# weights published in half precision: the encoder may compute in it (runner.py's encoder_dtype)
_HALF = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}


def is_mmproj(path: Path) -> bool:
    """A GGUF file whose architecture is llama.cpp's "clip" (a multimodal projector, not a text model)."""
    if not path.is_file():
        return False
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            return False
    try:
        return GGUFContents(path).metadata.get("general.architecture") == "clip"
    except Exception:  # struct, numpy or utf-8 decoding on a bad file: not one we can load either way
        return False


def load_mmproj(path: Path, device: str | torch.device = "cpu") -> tuple[Idefics3Vision | Gemma3Vision,
                                                                         ImageProcessing]:
    """The vision tower + projector (float32, eval mode, on `device`) and its preprocessing, from an mmproj GGUF;
    its family is the model's `vision`. ModelLoadError when the file is no projector read here or lacks a tensor or
    key."""
    path = Path(path)
    contents = _open(path)
    metadata = contents.metadata
    family = projector_family(metadata)
    config = _config(metadata, path, family)
    model = Idefics3Vision.from_config(config) if family == "idefics3" else Gemma3Vision.from_config(config)
    state = _state_dict(contents.tensors, config["vision_config"], path, family)
    missing = sorted(_gguf_name(name, family) for name in model.state_dict() if f"model.{name}" not in state)
    if missing:
        raise ModelLoadError(f"{path.name} is missing tensor(s): {', '.join(missing[:5])}")
    model.load_state_dict_hf(state)  # shapes are checked there
    stored = {t.tensor_type for t in contents.tensors if t.name.startswith("v.blk.")}
    model.stored_dtype = next((_HALF[kind] for kind in stored if kind in _HALF), torch.float32)
    processing = _processing(metadata, config) if family == "idefics3" else _gemma3_processing(metadata, config)
    return model.to(device=device).eval(), processing


def projector_family(metadata: dict[str, Any]) -> str:
    """The file's projector type (clip.*), one of PROJECTORS: the vision family of the model it goes with."""
    return str(metadata.get("clip.vision.projector_type", metadata.get("clip.projector_type")))


def _open(path: Path) -> GGUFContents:
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist or is not a file")
    try:
        contents = GGUFContents(path)
    except Exception as error:  # struct, numpy or utf-8 decoding on a bad file
        raise ModelLoadError(f"cannot read {path} as GGUF (truncated or corrupt?): {error}") from error
    metadata = contents.metadata
    if metadata.get("general.architecture") != "clip":
        raise ModelLoadError(f"{path.name} is not a multimodal projector (mmproj) GGUF: its architecture is "
                             f"{metadata.get('general.architecture')!r}, not 'clip'")
    if not metadata.get("clip.has_vision_encoder"):
        raise ModelLoadError(f"{path.name} has no vision encoder (clip.has_vision_encoder)")
    projector = projector_family(metadata)
    if projector not in PROJECTORS:
        raise ModelLoadError(f"{path.name}: projector type {projector!r} is not supported; supported: "
                             f"{', '.join(PROJECTORS)}")
    return contents


def _config(metadata: dict[str, Any], path: Path, family: str) -> dict[str, Any]:
    """The clip.* metadata as the config.json dict the family's vision module reads."""

    def get(key: str) -> Any:
        if key not in metadata:
            raise ModelLoadError(f"{path.name} lacks the metadata key {key}")
        return metadata[key]

    if not metadata.get("clip.use_gelu", False):  # llama.cpp's FFN is then SiLU, which no Idefics3 has
        raise ModelLoadError(f"{path.name}: only GELU vision MLPs are supported (clip.use_gelu is not set)")
    vision: dict[str, Any] = {"hidden_size": int(get("clip.vision.embedding_length")),
        "intermediate_size": int(get("clip.vision.feed_forward_length")),
        "num_hidden_layers": int(get("clip.vision.block_count")),
        "num_attention_heads": int(get("clip.vision.attention.head_count")),
        "image_size": int(get("clip.vision.image_size")), "patch_size": int(get("clip.vision.patch_size")),
        # NOTE: the file holds eps as float32 (1e-6 reads 9.99999997e-07), a difference far below float32's
        "layer_norm_eps": float(get("clip.vision.attention.layer_norm_epsilon")),
        # ggml's GELU (llama.cpp's FFN_GELU) is the tanh approximation SigLIP's gelu_pytorch_tanh names
        "hidden_act": "gelu_pytorch_tanh"}
    text = {"hidden_size": int(get("clip.vision.projection_dim"))}
    if family == "gemma3":
        side = vision["image_size"] // vision["patch_size"] // int(metadata.get("clip.vision.projector.scale_factor",
                                                                                 GEMMA3_MERGE))
        return {"vision_config": vision, "text_config": text, "mm_tokens_per_image": side * side}
    return {"vision_config": vision, "text_config": text,
            "scale_factor": int(metadata.get("clip.vision.projector.scale_factor", 2))}


def _processing(metadata: dict[str, Any], config: dict[str, Any]) -> Idefics3Processing:
    """The preprocessing llama.cpp applies to this file (tools/mtmd/clip.cpp, mtmd-image.cpp), as transformers'
    Idefics3ImageProcessor settings: LANCZOS resizes, tiles of the tower's image size, splitting always on."""
    tile = config["vision_config"]["image_size"]
    longest_edge = int(metadata.get("clip.vision.preproc_image_size", TILES_PER_LONGEST_EDGE * tile))
    preprocessor = {"size": {"longest_edge": longest_edge}, "max_image_size": {"longest_edge": tile},
                    "resample": Image.Resampling.LANCZOS, "do_image_splitting": True,
                    "image_mean": [float(v) for v in metadata.get("clip.vision.image_mean", [0.5] * 3)],
                    "image_std": [float(v) for v in metadata.get("clip.vision.image_std", [0.5] * 3)]}
    return Idefics3Processing.from_config(preprocessor, {}, config)  # image_seq_len from the config


def _gemma3_processing(metadata: dict[str, Any], config: dict[str, Any]) -> Gemma3Processing:
    """The preprocessing llama.cpp applies to a Gemma 3 file: the image resized (bilinear) to the tower's square."""
    tile = config["vision_config"]["image_size"]
    preprocessor = {"size": {"height": tile, "width": tile}, "resample": Image.Resampling.BILINEAR,
                    "image_mean": [float(v) for v in metadata.get("clip.vision.image_mean", [0.5] * 3)],
                    "image_std": [float(v) for v in metadata.get("clip.vision.image_std", [0.5] * 3)]}
    return Gemma3Processing.from_config(preprocessor, {}, config)


def _state_dict(tensors: list[GGUFTensor], vision: dict[str, Any], path: Path,
                family: str) -> dict[str, torch.Tensor]:
    """The file's tensors under the checkpoint's names (`model.` + module path), float32. The converter keeps
    PyTorch's layouts (conv weight [out, in, p, p], Linear [out, in], Q/K/V unpermuted: the tower has no RoPE), but
    Gemma 3's projection is a bare matrix and its soft-embedding norm is stored with Gemma's 1 added."""
    state = {}
    for tensor in tensors:
        name = _hf_name(tensor.name, family)
        if name is None:
            raise ModelLoadError(f"{path.name}: unexpected tensor {tensor.name} for a {family} projector")
        state[f"model.{name}"] = _array(tensor)
    _unswap_ffn(state, vision["hidden_size"], vision["intermediate_size"])
    if family == "gemma3":
        projection = state.pop("model.multi_modal_projector.mm_input_projection.weight", None)
        if projection is not None:
            state["model.multi_modal_projector.mm_input_projection_weight"] = projection
        norm = "model.multi_modal_projector.mm_soft_emb_norm.weight"
        if norm in state:
            state[norm] = state[norm] - 1.0
    return state


def _hf_name(gguf_name: str, family: str) -> str | None:
    """v.blk.3.attn_q.weight -> vision_model.encoder.layers.3.self_attn.q_proj.weight, under the family's tower
    (None: not a known name)."""
    module, _, leaf = gguf_name.rpartition(".")
    if leaf not in ("weight", "bias"):
        return None
    tower = _TOWER[family]
    if module in _GLOBAL_NAMES:
        name = _GLOBAL_NAMES[module]
        return f"{name}.{leaf}" if name.startswith(("connector.", "multi_modal_projector.")) else \
            f"{tower}{name}.{leaf}"
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in _LAYER_NAMES:
        return f"{tower}vision_model.encoder.layers.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{leaf}"
    return None


def _gguf_name(hf_name: str, family: str) -> str:
    """The inverse of _hf_name, to name a missing tensor as the file would."""
    if hf_name == "multi_modal_projector.mm_input_projection_weight":
        return "mm.input_projection.weight"
    module, _, leaf = hf_name.removeprefix(_TOWER[family]).rpartition(".")
    for gguf_module, name in _GLOBAL_NAMES.items():
        if module == name:
            return f"{gguf_module}.{leaf}"
    _, _, _, layer, part = module.split(".", 4)
    short = next(key for key, name in _LAYER_NAMES.items() if name == part)
    return f"v.blk.{layer}.{short}.{leaf}"


def _unswap_ffn(state: dict[str, torch.Tensor], hidden: int, intermediate: int) -> None:
    """Files from an old converter named each layer's MLP tensors the wrong way round (ffn_down for fc1); llama.cpp
    swaps them back when ffn_down reads the hidden width, and so do we (unambiguous only when the widths differ)."""
    if hidden == intermediate:
        return
    for name in [n for n in state if n.endswith(".mlp.fc2.weight")]:
        if tuple(state[name].shape) == (intermediate, hidden):
            prefix = name.removesuffix("fc2.weight")
            for leaf in ("weight", "bias"):
                up, down = f"{prefix}fc1.{leaf}", f"{prefix}fc2.{leaf}"
                if up in state and down in state:
                    state[up], state[down] = state[down], state[up]


def _array(tensor: GGUFTensor) -> torch.Tensor:
    return torch.from_numpy(tensor_array(tensor))
