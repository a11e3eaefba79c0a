"""config.json parsing, safetensors loading (single and sharded), generation defaults, load errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.loader import load_model, read_generation_defaults, resolve_dtype, weight_files
from pagegate.engine.models.config import ModelConfig, RopeConfig

from ..conftest import SavedModel, hf

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def _copy(saved: SavedModel, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved.path, tmp_path / "model"))


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_config_fields_from_saved_folders(llama_model: SavedModel, head_dim_model: SavedModel,
                                          mistral_model: SavedModel, qwen2_model: SavedModel) -> None:
    llama = ModelConfig.from_folder(llama_model.path)
    assert (llama.architecture, llama.head_dim, llama.num_key_value_heads) == ("LlamaForCausalLM", 16, 2)
    assert (llama.bos_token_id, llama.eos_token_ids, llama.torch_dtype) == (1, (2,), "float32")
    assert llama.sliding_window is None and not llama.tie_word_embeddings and not llama.qkv_bias
    head_dim = ModelConfig.from_folder(head_dim_model.path)
    assert head_dim.head_dim == 32
    assert (head_dim.qkv_bias, head_dim.o_bias, head_dim.mlp_bias) == (True, True, True)
    mistral = ModelConfig.from_folder(mistral_model.path)
    assert [mistral.sliding_window_for(i) for i in range(2)] == [5, 5]
    qwen2 = ModelConfig.from_folder(qwen2_model.path)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings) == (True, False, True)
    assert [qwen2.sliding_window_for(i) for i in range(2)] == [None, None]


def test_rope_classic_and_rope_parameters_forms_agree() -> None:
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    theta = {"rope_theta": 500000.0}
    classic = ModelConfig.from_dict({**BASE, **theta, "rope_scaling": {"rope_type": "llama3", **llama3}})
    older = ModelConfig.from_dict({**BASE, **theta, "rope_scaling": {"type": "llama3", **llama3}})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "llama3", **theta, **llama3}})
    expected = RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert classic.rope == older.rope == new.rope == expected
    assert ModelConfig.from_dict({**BASE, "rope_theta": 1e6}).rope == RopeConfig(theta=1e6)
    assert ModelConfig.from_dict(BASE).rope == RopeConfig()


def test_config_without_head_dim_derives_it_and_reads_dtype_key() -> None:
    config = ModelConfig.from_dict({**BASE, "head_dim": None, "dtype": "bfloat16"})
    assert config.head_dim == 16 and config.torch_dtype == "bfloat16"
    assert ModelConfig.from_dict({**BASE, "torch_dtype": "float16"}).torch_dtype == "float16"
    assert ModelConfig.from_dict({**BASE, "eos_token_id": [2, 9]}).eos_token_ids == (2, 9)


def test_qwen2_sliding_window_applies_per_layer() -> None:
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "num_hidden_layers": 3}
    assert ModelConfig.from_dict(qwen).sliding_window_for(2) is None  # use_sliding_window is false
    by_index = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert [by_index.sliding_window_for(i) for i in range(3)] == [None, 64, 64]
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    by_type = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "layer_types": types})
    assert [by_type.sliding_window_for(i) for i in range(3)] == [64, None, 64]


def test_mistral_null_sliding_window_means_full_attention() -> None:
    config = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert config.sliding_window_for(0) is None


@pytest.mark.parametrize("changes, words", [
    ({"architectures": ["GPT2LMHeadModel"]}, ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM"]),
    ({"architectures": None, "model_type": "gpt2"}, ["gpt2", "MistralForCausalLM"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["yarn", "llama3"]),
    ({"hidden_act": "gelu"}, ["gelu"]),
])
def test_unsupported_configs_fail_with_a_clear_message(changes: dict, words: list[str]) -> None:
    with pytest.raises(ModelLoadError) as error:
        ModelConfig.from_dict({**BASE, **changes})
    assert all(word in str(error.value) for word in words)


def test_architecture_inferred_from_model_type() -> None:
    config = ModelConfig.from_dict({**BASE, "architectures": None, "model_type": "qwen2"})
    assert config.architecture == "Qwen2ForCausalLM"


def test_load_copies_every_weight(llama_model: SavedModel) -> None:
    model, config, generation = load_model(llama_model.path)
    hf = llama_model.hf_model
    layer = model.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split(layer.self_attn.qkv_proj.shard_sizes)
    assert torch.equal(q, hf.model.layers[1].self_attn.q_proj.weight)
    assert torch.equal(v, hf.model.layers[1].self_attn.v_proj.weight)
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, hf.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert generation.eos_token_ids == [2]


def test_tied_checkpoint_without_lm_head_shares_embeddings(qwen2_model: SavedModel) -> None:
    assert "lm_head.weight" not in load_file(qwen2_model.path / "model.safetensors")
    model, _, _ = load_model(qwen2_model.path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.bias[:64],
                       qwen2_model.hf_model.model.layers[0].self_attn.q_proj.bias)


def test_sharded_checkpoint_reads_every_shard(sharded_model: SavedModel) -> None:
    files = weight_files(sharded_model.path)
    assert len(files) > 1 and (sharded_model.path / "model.safetensors.index.json").is_file()
    model, _, _ = load_model(sharded_model.path)
    assert torch.equal(model.model.norm.weight, sharded_model.hf_model.model.norm.weight)
    assert torch.equal(model.model.embed_tokens.weight, sharded_model.hf_model.model.embed_tokens.weight)


def test_missing_tensor_is_named(llama_model: SavedModel, tmp_path: Path) -> None:
    folder = _copy(llama_model, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder)


def test_shape_mismatch_is_named(llama_model: SavedModel, tmp_path: Path) -> None:
    folder = _copy(llama_model, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, folder / "model.safetensors")
    pattern = r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(16, 64\).*\(32, 64\)"
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(folder)


def test_unexpected_tensor_is_named_but_rotary_buffers_are_ignored(llama_model: SavedModel,
                                                                    tmp_path: Path) -> None:
    folder = _copy(llama_model, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, folder / "model.safetensors")
    load_model(folder)
    tensors["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model\.layers\.7\.self_attn\.q_proj"):
        load_model(folder)


def test_untied_model_without_lm_head_fails(llama_model: SavedModel, tmp_path: Path) -> None:
    folder = _copy(llama_model, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_model(folder)


def test_folder_without_weights_or_config_fails(llama_model: SavedModel, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    folder = _copy(llama_model, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(folder)


def test_generation_config_eos_and_sampling_defaults(llama_model: SavedModel, tmp_path: Path) -> None:
    folder = _copy(llama_model, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7, 2], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True}))
    defaults = read_generation_defaults(folder, ModelConfig.from_folder(folder))
    assert defaults.eos_token_ids == [7, 2]
    assert defaults.sampling_overrides() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    _edit_json(folder / "generation_config.json", eos_token_id=5)
    assert read_generation_defaults(folder, ModelConfig.from_folder(folder)).eos_token_ids == [5, 2]


def test_dtype_resolution(llama_model: SavedModel) -> None:
    config = ModelConfig.from_dict({**BASE, "torch_dtype": "bfloat16"})
    assert resolve_dtype("auto", config, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", config, torch.device("cpu")) == torch.float16
    with pytest.raises(ModelLoadError, match="int8"):
        resolve_dtype("int8", config, torch.device("cpu"))
    model, _, _ = load_model(llama_model.path, dtype="float16")
    assert model.dtype == torch.float16


def test_half_checkpoint_loads_exact_values_in_any_dtype(half_model: SavedModel) -> None:
    name = str(half_model.hf_model.dtype).removeprefix("torch.")
    assert ModelConfig.from_folder(half_model.path).torch_dtype == name  # transformers 5 writes "dtype"
    theirs = half_model.hf_model.model.layers[1].self_attn.q_proj.weight
    as_float, _, _ = load_model(half_model.path)  # auto on CPU: float32 holding the half values
    as_half, _, _ = load_model(half_model.path, dtype=name)
    assert (as_float.dtype, as_half.dtype) == (torch.float32, half_model.hf_model.dtype)
    for model, dtype in ((as_float, torch.float32), (as_half, half_model.hf_model.dtype)):
        q = model.model.layers[1].self_attn.qkv_proj.weight[:64]
        assert torch.equal(q, theirs.to(dtype))
        assert torch.equal(model.lm_head.weight, half_model.hf_model.lm_head.weight.to(dtype))


def test_generation_config_written_by_transformers(llama_model: SavedModel, tmp_path: Path) -> None:
    folder = _copy(llama_model, tmp_path)
    hf().GenerationConfig(bos_token_id=1, eos_token_id=[9, 2], temperature=0.7, do_sample=True).save_pretrained(folder)
    defaults = read_generation_defaults(folder, ModelConfig.from_folder(folder))
    assert defaults.eos_token_ids == [9, 2] and defaults.sampling_overrides() == {"temperature": 0.7}
