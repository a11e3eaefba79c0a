"""A tiny random SmolVLM (Idefics3: a SigLIP vision tower, a pixel-shuffle connector and a Llama text model) saved
as a Hugging Face folder the way SmolVLM's own is laid out: config.json with text_config and vision_config,
model.safetensors, tokenizer.json with the image tokens, processor_config.json and preprocessor_config.json, and
SmolVLM's chat template. transformers' own Idefics3Processor and model read it, so tests compare against them.
Likewise a tiny random Gemma 3 (save_gemma3_vision), laid out as google/gemma-3-4b-it is."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
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


# --- Gemma 3 (Gemma3ForConditionalGeneration: a SigLIP tower, an average-pool projector, a Gemma 3 text model) ---

GEMMA3_TILE = 56  # the tower's image size: 4 x 4 patches of 14 (gemma-3-4b-it: 896, 64 x 64)
GEMMA3_SEQ_LEN = 4  # mm_tokens_per_image: the patch grid average-pooled 2 x 2 (gemma-3-4b-it: 256, pooled 4 x 4)
# gemma-3-4b-it's chat template (its chat_template.json); an image part renders as <start_of_image>
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
# in gemma-3-4b-it's order (ids 105, 106, 255999, 256000, 262144 there); bos and eos are the base tokenizer's
GEMMA3_SPECIAL = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def _save_gemma3_tokenizer(folder: Path) -> dict[str, int]:
    tokenizer = Tokenizer.from_file(str(BASE_TOKENIZER))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in GEMMA3_SPECIAL])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
              "pad_token": "<|end_of_text|>", "add_bos_token": True, "add_eos_token": False,
              "model_max_length": 4096, "chat_template": GEMMA3_CHAT_TEMPLATE,
              "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                       "image_token": "<image_soft_token>"}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    ids = {token: tokenizer.token_to_id(token) for token in ["<|begin_of_text|>", "<|end_of_text|>", *GEMMA3_SPECIAL]}
    return {token: id_ for token, id_ in ids.items() if id_ is not None}


@dataclass(frozen=True)
class Gemma3Shape:
    """A Gemma 3's widths: its text model's (6 layers: 5 sliding, 1 full), its vision tower's, its image tokens."""

    text: dict[str, Any]
    vision: dict[str, Any]
    tokens: int  # mm_tokens_per_image

    @property
    def tile(self) -> int:
        return int(self.vision["image_size"])


GEMMA3_TINY = Gemma3Shape(dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, query_pre_attn_scalar=16, sliding_window=512),
                          dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               patch_size=14, image_size=GEMMA3_TILE), GEMMA3_SEQ_LEN)
# gemma-3-4b-it's widths (its vocabulary and 28 of its 34 text layers aside): 896-pixel images, 256 image tokens.
# Untied: with random weights six layers move the stream too little, and a tied head then repeats its input token.
GEMMA3_4B = Gemma3Shape(dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, tie_word_embeddings=False),
                        dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                             patch_size=14, image_size=896), 256)


def _save_gemma3_processor(folder: Path, shape: Gemma3Shape) -> None:
    image = {"image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": None, "do_resize": True,
             "size": {"height": shape.tile, "width": shape.tile}, "resample": 2, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": None, "pan_and_scan_min_crop_size": None,
             "pan_and_scan_max_num_crops": None, "pan_and_scan_min_ratio_to_activate": None,
             "processor_class": "Gemma3Processor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": shape.tokens,
                                                              "processor_class": "Gemma3Processor"}, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA3_CHAT_TEMPLATE}))


def gemma3_config(ids: dict[str, int], vocab: int, shape: Gemma3Shape = GEMMA3_TINY) -> Any:
    """A Gemma 3 of `shape`: 6 text layers, 5 sliding and the last full attention as gemma-3-4b-it's (and llama.cpp's
    default for a GGUF, which records no pattern), its rope as gemma-3-4b-it's (linear x8 on the full layers' 1e6
    base, 1e4 on the sliding ones)."""
    text = dict(shape.text, vocab_size=vocab, num_hidden_layers=6,
                layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=2048,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
                pad_token_id=ids["<|end_of_text|>"])
    transformers: Any = hf()
    return transformers.Gemma3Config(text_config=text, vision_config=dict(shape.vision, vision_use_head=False),
                                     tie_word_embeddings=shape.text.get("tie_word_embeddings", True),
                                     mm_tokens_per_image=shape.tokens, boi_token_index=ids["<start_of_image>"],
                                     eoi_token_index=ids["<end_of_image>"],
                                     image_token_index=ids["<image_soft_token>"],
                                     eos_token_id=[ids["<|end_of_text|>"], ids["<end_of_turn>"]])


def _checkpoint_names(file: Path) -> None:
    """Rename the tower's tensors as gemma-3-4b-it's checkpoint has them: transformers 5 saves `vision_tower.*`
    (its SiglipVisionModel has no `vision_model` level), the published files hold `vision_tower.vision_model.*`."""
    tensors = load_file(str(file))
    renamed = {re.sub(r"^vision_tower\.", "vision_tower.vision_model.", name): tensor
               for name, tensor in tensors.items()}
    save_file(renamed, str(file), metadata={"format": "pt"})


def _randomize_by_width(model: torch.nn.Module, seed: int) -> None:
    """_randomize for real widths: matrices scaled by 1 / sqrt(their inputs), so activations stay near unit size and
    the logits tell tokens apart (0.15 a weight at 2560 wide saturates every softmax: one token wins always)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name or param.dim() < 2:
                param.copy_(0.1 * noise if "norm" in name else 0.02 * noise)  # Gemma's norms scale by 1 + w
            else:
                inputs = param.shape[0] if name.endswith("mm_input_projection_weight") else param[0].numel()
                param.copy_(noise / inputs**0.5)


def save_gemma3_vision(folder: Path, seed: int = 0, shape: Gemma3Shape = GEMMA3_TINY) -> SavedModel:
    """A random Gemma 3 vision-language model (GEMMA3_TINY unless `shape` says otherwise) in `folder`, laid out as
    google/gemma-3-4b-it is."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = _save_gemma3_tokenizer(folder)
    _save_gemma3_processor(folder, shape)
    torch.manual_seed(seed)
    transformers: Any = hf()
    config = gemma3_config(ids, max(ids.values()) + 1, shape)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    if shape is GEMMA3_TINY:
        _randomize(model, seed)
    else:
        _randomize_by_width(model, seed)
    model.eval()
    model.save_pretrained(folder)
    _checkpoint_names(folder / "model.safetensors")
    json.dump({"bos_token_id": ids["<|begin_of_text|>"], "pad_token_id": ids["<|end_of_text|>"],
               "eos_token_id": [ids["<|end_of_text|>"], ids["<end_of_turn>"]]},
              open(folder / "generation_config.json", "w"))
    return SavedModel(folder, model)
