"""The Idefics3 vision tower and connector against transformers' get_image_features on the tiny SmolVLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.image_step import encoder_dtype
from pagegate.engine.media.idefics3 import Idefics3Processing
from pagegate.engine.models.idefics3_vision import (
    Idefics3Vision,
    Idefics3VisionConfig,
    load_idefics3_vision,
    tile_position_ids,
)
from tests.engine.conftest import SavedModel
from tests.engine.vision_models import SEQ_LEN, save_smolvlm


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_smolvlm(tmp_path_factory.mktemp("smolvlm"), seed=3)


def _tiles(model: SavedModel, height: int, width: int) -> torch.Tensor:
    pixels = np.random.default_rng(7).integers(0, 256, (height, width, 3), dtype=np.uint8)
    processing = Idefics3Processing.from_folder(model.path)
    return torch.from_numpy(processing.normalize(processing.prepare(pixels).tiles))


def test_matches_transformers_on_a_split_image(smolvlm: SavedModel) -> None:
    tiles = _tiles(smolvlm, 200, 300)  # 2 x 2 tiles and the global image
    assert tiles.shape[0] == 5
    mask = torch.ones(1, tiles.shape[0], *tiles.shape[2:], dtype=torch.long)  # every pixel real
    with torch.no_grad():
        features = smolvlm.hf_model.model.get_image_features(tiles[None], mask)
    expected = torch.cat(features.pooler_output)

    got = load_idefics3_vision(smolvlm.path).encode(tiles)

    assert got.shape == (5 * SEQ_LEN, 64) == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_position_ids_follow_transformers_buckets() -> None:
    assert torch.equal(tile_position_ids(8), torch.arange(64))
    rows = tile_position_ids(19).view(19, 19)[:, 0] // 19  # 12 * (1/19) rounds into bucket 11
    assert rows[12] == 11 and rows[13] == 13


def test_load_rejects_missing_tensors(smolvlm: SavedModel) -> None:
    model = Idefics3Vision.from_config({"vision_config": {"hidden_size": 32, "image_size": 128, "patch_size": 16,
                                                          "num_attention_heads": 2, "intermediate_size": 64,
                                                          "num_hidden_layers": 2},
                                        "text_config": {"hidden_size": 64}, "scale_factor": 2})
    assert model.config.image_seq_len == SEQ_LEN
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    state.pop("model.connector.modality_projection.proj.weight")
    with pytest.raises(ModelLoadError, match="proj"):
        model.load_state_dict_hf(state)


def test_config_rejects_unshufflable_grid() -> None:
    with pytest.raises(ModelLoadError, match="shuffle"):
        Idefics3VisionConfig.from_dict({"vision_config": {"image_size": 96, "patch_size": 32}, "scale_factor": 2})


def test_the_encoder_computes_in_its_weights_published_precision(smolvlm: SavedModel) -> None:
    """float32 weights keep float32 arithmetic (the reference's); half-precision ones run bfloat16 matmuls on a CPU
    that has them natively, and their rows stay float32 and near the float32 ones."""
    vision = load_idefics3_vision(smolvlm.path)
    assert vision.stored_dtype == torch.float32
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert encoder_dtype(torch.float32, cpu) == torch.float32 == encoder_dtype(torch.float32, cuda)
    assert encoder_dtype(torch.float16, cuda) == torch.float16
    assert encoder_dtype(torch.bfloat16, cpu) in (torch.bfloat16, torch.float32)
    tiles = _tiles(smolvlm, 150, 150)
    exact = vision.encode(tiles)
    vision.compute_dtype = torch.bfloat16
    rounded = vision.encode(tiles)
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
    torch.testing.assert_close(rounded, exact, atol=0.1 * exact.abs().max().item(), rtol=0)
