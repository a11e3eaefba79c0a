"""The Gemma 3 vision tower and projector against transformers' get_image_features: on the tiny Gemma 3 (saved with
the published checkpoint's tensor names) and on one with gemma-3-4b-it's vision shapes but one layer (saved with
transformers 5's names)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.media.gemma3 import Gemma3Processing
from pagegate.engine.models.gemma3_vision import (
    Gemma3Vision,
    Gemma3VisionConfig,
    checkpoint_name,
    load_gemma3_vision,
)
from tests.engine.conftest import SavedModel, _randomize, hf
from tests.engine.vision_models import GEMMA3_SEQ_LEN, save_gemma3_vision

# gemma-3-4b-it's config.json, as published (transformers' defaults fill what it leaves out)
GEMMA3_4B_CONFIG: dict[str, Any] = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
                    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
                    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
                    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                    "sliding_window": 1024},
                    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_gemma3_vision(tmp_path_factory.mktemp("gemma3"), seed=3)


def _pixel_values(folder: Path, *sizes: tuple[int, int]) -> torch.Tensor:
    processing = Gemma3Processing.from_folder(folder)
    rng = np.random.default_rng(7)
    tiles = np.concatenate([processing.prepare(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).tiles
                            for size in sizes])
    return torch.from_numpy(processing.normalize(tiles))


def _expected(model: Any, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values).pooler_output
    return features.reshape(-1, features.shape[-1])


def test_matches_transformers(gemma3: SavedModel) -> None:
    pixel_values = _pixel_values(gemma3.path, (50, 70), (300, 20), (56, 56))
    expected = _expected(gemma3.hf_model, pixel_values)

    vision = load_gemma3_vision(gemma3.path)
    got = vision.encode(pixel_values)

    assert got.shape == (3 * GEMMA3_SEQ_LEN, 64) == expected.shape
    assert vision.config.image_seq_len == GEMMA3_SEQ_LEN and vision.config.image_size == 56
    assert vision.config.text_hidden_size == 64
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_matches_transformers_at_gemma3_4b_shapes(tmp_path: Path) -> None:
    """896-pixel images of 64 x 64 patches, 1152 wide, pooled 4 x 4 to 256 tokens: one layer of the 27."""
    transformers: Any = hf()
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        vision_config={**GEMMA3_4B_CONFIG["vision_config"], "num_hidden_layers": 1},
        mm_tokens_per_image=256, boi_token_index=297, eoi_token_index=298, image_token_index=299)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    _randomize(model, 0)
    model.eval()
    model.save_pretrained(tmp_path)  # transformers 5's names: vision_tower.encoder..., no vision_model level
    processing = Gemma3Processing.from_config({"size": {"height": 896, "width": 896}}, {}, config.to_dict())
    pixels = np.random.default_rng(1).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    pixel_values = torch.from_numpy(processing.normalize(processing.prepare(pixels).tiles))

    got = load_gemma3_vision(tmp_path).encode(pixel_values)

    assert got.shape == (256, 64)
    torch.testing.assert_close(got, _expected(model, pixel_values), atol=0, rtol=0)


def test_reads_gemma3_4b_config() -> None:
    config = Gemma3VisionConfig.from_dict(GEMMA3_4B_CONFIG)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads) == (
        1152, 4304, 27, 16)
    assert (config.image_size, config.patch_size, config.patches_per_side, config.layer_norm_eps) == (896, 14, 64,
                                                                                                        1e-6)
    assert (config.image_seq_len, config.tokens_per_side, config.text_hidden_size) == (256, 16, 2560)
    assert config.hidden_act == "gelu_pytorch_tanh"


def test_config_rejects_an_uneven_pool() -> None:
    for tokens in (200, 9):  # not a square; 3 x 3 does not divide 64 x 64 patches
        with pytest.raises(ModelLoadError, match="pool"):
            Gemma3VisionConfig.from_dict({**GEMMA3_4B_CONFIG, "mm_tokens_per_image": tokens})


def test_checkpoint_names() -> None:
    tower = "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert checkpoint_name(tower) == tower
    assert checkpoint_name("vision_tower.encoder.layers.0.mlp.fc1.weight") == tower
    assert checkpoint_name("model.vision_tower.encoder.layers.0.mlp.fc1.weight") == tower
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    assert checkpoint_name(f"model.{norm}") == checkpoint_name(norm) == norm
    for other in ("language_model.model.embed_tokens.weight", "model.language_model.norm.weight", "lm_head.weight",
                  "vision_tower.vision_model.head.probe"):
        assert checkpoint_name(other) is None


def test_load_rejects_missing_tensors() -> None:
    model = Gemma3Vision.from_config({"vision_config": {"hidden_size": 32, "image_size": 56, "patch_size": 14,
                                                        "num_attention_heads": 2, "intermediate_size": 64,
                                                        "num_hidden_layers": 2},
                                      "text_config": {"hidden_size": 64}, "mm_tokens_per_image": 4})
    state = dict(model.state_dict())
    state.pop("multi_modal_projector.mm_input_projection_weight")
    with pytest.raises(ModelLoadError, match="mm_input_projection_weight"):
        model.load_state_dict_hf(state)


def test_the_encoder_computes_in_its_compute_dtype(gemma3: SavedModel) -> None:
    """float32 weights keep float32 arithmetic; bfloat16 matmuls give float32 rows near the float32 ones."""
    vision = load_gemma3_vision(gemma3.path)
    assert vision.stored_dtype == torch.float32
    pixel_values = _pixel_values(gemma3.path, (80, 60))
    exact = vision.encode(pixel_values)
    vision.compute_dtype = torch.bfloat16
    rounded = vision.encode(pixel_values)
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
    torch.testing.assert_close(rounded, exact, atol=0.1 * exact.abs().max().item(), rtol=0)


def test_the_text_model_of_a_published_config_is_the_one_transformers_reads() -> None:
    """gemma-3-4b-it's config.json leaves most of its text model to Gemma3TextConfig's defaults: pagegate reads the
    same model from it as from the config transformers completes (and its head is tied: no lm_head tensor)."""
    from pagegate.engine.models.config import ModelConfig

    transformers: Any = hf()
    completed = transformers.Gemma3Config(**GEMMA3_4B_CONFIG).to_dict()
    ours, theirs = ModelConfig.from_dict(GEMMA3_4B_CONFIG), ModelConfig.from_dict(completed)
    # the special tokens aside: transformers gives the text model its own defaults (eos 1), pagegate the model's
    assert ours.eos_token_ids == (1, 106)
    assert ours == replace(theirs, bos_token_id=ours.bos_token_id, eos_token_ids=ours.eos_token_ids)
    assert (ours.vocab_size, ours.num_attention_heads, ours.head_dim, ours.tie_word_embeddings) == (262208, 8, 256, True)
    assert ours.layer_sliding_windows == (1024,) * 5 + (None,) + (1024,) * 5 + (None,) + ours.layer_sliding_windows[12:]
    assert (ours.vision, ours.image_token_id) == ("gemma3", 262144)
