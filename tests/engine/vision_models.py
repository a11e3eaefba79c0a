"""A tiny random SmolVLM (Idefics3: a SigLIP vision tower, a pixel-shuffle connector and a Llama text model) saved
as a Hugging Face folder the way SmolVLM's own is laid out: config.json with text_config and vision_config,
model.safetensors, tokenizer.json with the image tokens, processor_config.json and preprocessor_config.json, and
SmolVLM's chat template. transformers' own Idefics3Processor and model read it, so tests compare against them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from .conftest import SavedModel, _randomize, hf

BASE_TOKENIZER = Path(__file__).parents[2] / "pagegate" / "engine" / "default_model" / "tokenizer.json"
GRID = 6  # <row_r_col_c> tokens for tiles up to GRID x GRID, as SmolVLM's vocabulary has
SEQ_LEN = 16  # image tokens per tile: (128 / 16)^2 patches, pixel-shuffled by 2 in each direction
TILE = 128  # the vision tower's image size (SmolVLM's: 512)
LONGEST_EDGE = 2 * TILE  # images are resized so their longest edge is at most this, then cut into tiles

# SmolVLM-256M-Instruct's chat template, as its tokenizer_config.json has it
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SPECIAL = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>",
           *[f"<row_{r}_col_{c}>" for r in range(1, GRID + 1) for c in range(1, GRID + 1)]]


def _save_tokenizer(folder: Path) -> dict[str, int]:
    tokenizer = Tokenizer.from_file(str(BASE_TOKENIZER))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<end_of_utterance>", "pad_token": "<|end_of_text|>", "add_bos_token": False,
              "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
              "extra_special_tokens": {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                                       "global_image_token": "<global-img>", "end_of_utterance_token":
                                       "<end_of_utterance>"}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {token: tokenizer.token_to_id(token) for token in SPECIAL}


@dataclass(frozen=True)
class Shape:
    """A SmolVLM's widths: its text model's and vision tower's, the pixel shuffle, the tile and the longest edge."""

    text: dict[str, Any]
    vision: dict[str, Any]
    scale_factor: int
    longest_edge: int

    @property
    def tile(self) -> int:
        return int(self.vision["image_size"])

    @property
    def seq_len(self) -> int:
        return (self.tile // self.vision["patch_size"] // self.scale_factor) ** 2


TINY = Shape(dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048),
             dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=16,
                  image_size=TILE), scale_factor=2, longest_edge=LONGEST_EDGE)
# SmolVLM-256M-Instruct's (its vocabulary aside): 512-pixel tiles of 64 tokens, images resized to 2048 first
SMOLVLM_256M = Shape(dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, max_position_embeddings=8192),
                     dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                          patch_size=16, image_size=512), scale_factor=4, longest_edge=2048)


def _save_processor(folder: Path, splitting: bool, shape: Shape) -> None:
    image = {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
             "size": {"longest_edge": shape.longest_edge}, "resample": 1, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "do_image_splitting": splitting, "do_pad": True,
             "max_image_size": {"longest_edge": shape.tile}, "processor_class": "Idefics3Processor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": shape.seq_len,
                                                              "processor_class": "Idefics3Processor"}, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


def smolvlm_config(ids: dict[str, int], vocab: int, shape: Shape = TINY) -> Any:
    text = dict(shape.text, vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=0,
                eos_token_id=ids["<end_of_utterance>"], pad_token_id=1, tie_word_embeddings=False,
                architectures=["VLlama3ForCausalLM"])  # as SmolVLM's own: llama.cpp's converter picks its class by it
    return hf().Idefics3Config(text_config=text, vision_config=shape.vision, scale_factor=shape.scale_factor,
                               image_token_id=ids["<image>"], tie_word_embeddings=False)


def save_smolvlm(folder: Path, seed: int = 0, splitting: bool = True, shape: Shape = TINY) -> SavedModel:
    """A random SmolVLM (TINY unless `shape` says otherwise) in `folder`; its images cut into tiles (`splitting`)
    or resized to one tile."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = _save_tokenizer(folder)
    vocab = max(ids.values()) + 1
    _save_processor(folder, splitting, shape)
    torch.manual_seed(seed)
    model = hf().Idefics3ForConditionalGeneration(smolvlm_config(ids, vocab, shape)).to(torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(folder)
    json.dump({"eos_token_id": ids["<end_of_utterance>"], "bos_token_id": 0},
              open(folder / "generation_config.json", "w"))
    return SavedModel(folder, model)
