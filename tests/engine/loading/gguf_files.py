"""Write GGUF files from tiny transformers models the way llama.cpp's converter does (for tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

# Hugging Face name part -> llama.cpp's (the reverse of pagegate.engine.loading.gguf_file's map)
_LAYER_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}
_GLOBAL_PARTS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_F16_SCALES = {  # byte offsets of the float16 scales in one block of each type gguf cannot quantize
    GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,),
    GGMLQuantizationType.IQ4_NL: (0,)}

QuantChoice = Callable[[str, np.ndarray], GGMLQuantizationType]


def gguf_name(hf_name: str) -> str:
    module, leaf = hf_name.rsplit(".", 1)
    if module in _GLOBAL_PARTS:
        return f"{_GLOBAL_PARTS[module]}.{leaf}"
    _, _, layer, part = module.split(".", 3)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{leaf}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's two rotary halves interleaved."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def byte_vocab() -> list[str]:
    """A 256-token byte-level vocabulary (GPT-2's byte-to-character spelling); the last token is "ab"."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(255)] + ["ab"]


def random_blocks(qtype: GGMLQuantizationType, rows: int, columns: int, seed: int) -> np.ndarray:
    """Valid data of a type gguf has no quantizer for: random quants, small random float16 scales."""
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = columns // block_values
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for offset in _F16_SCALES[qtype]:
        scales = rng.uniform(0.001, 0.01, (rows, blocks)).astype(np.float16)
        data[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * block_bytes)


def write_gguf(path: Path, model: torch.nn.Module, arch: str = "llama",
               quant: QuantChoice = lambda name, values: GGMLQuantizationType.F32,
               skip: tuple[str, ...] = (), seed: int = 0) -> Path:
    """`model`'s config and weights as llama.cpp would write them; `quant` picks each 2-D tensor's type."""
    config = model.config
    writer = GGUFWriter(str(path), arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(byte_vocab()[:config.vocab_size])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for index, (name, tensor) in enumerate(model.state_dict().items()):
        if name in skip or "rotary_emb" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        values = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute(values, kv_heads)
        qtype = quant(name, values) if values.ndim == 2 else GGMLQuantizationType.F32
        _add_tensor(writer, gguf_name(name), values, qtype, seed + index)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, qtype: GGMLQuantizationType,
                seed: int) -> None:
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float16 if qtype.name == "F16" else None))
    elif qtype in _F16_SCALES:
        data = random_blocks(qtype, values.shape[0], values.shape[1], seed)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    else:
        data = quantize(np.ascontiguousarray(values), qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Q4_K blocks [rows, row bytes] of float rows (columns a multiple of 256): per 32 values a 6-bit scale
    and min of the block's float16 d and dmin, 4-bit quants (a plain round-to-nearest quantizer, not
    llama.cpp's search, decoded the same way)."""
    rows = values.shape[0]
    x = values.astype(np.float32).reshape(rows, -1, 8, 32)  # [rows, super-blocks, sub-blocks, 32]
    low = np.minimum(x.min(-1), 0.0)
    scale, minimum = (x.max(-1) - low) / 15, -low
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)
    sc = _ratio(scale, d, 63)
    mn = _ratio(minimum, dmin, 63)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    q = np.clip(np.rint((x + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, 15).astype(np.uint8)
    packed = np.zeros((*x.shape[:2], 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(*x.shape[:2], 128)  # sub-blocks 2i, 2i+1 share bytes
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, qs], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Q6_K blocks of float rows: per 16 values an int8 scale of the block's float16 d, 6-bit signed quants."""
    rows = values.shape[0]
    x = values.astype(np.float32).reshape(rows, -1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = _ratio(scale, d, 127).astype(np.int8)
    step = d.astype(np.float32)[..., None] * sc
    q = np.clip(np.rint(x / np.where(step > 0, step, 1)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(*x.shape[:2], 2, 4, 32)  # [.., half, quarter, l]: value 128h + 32k + l
    ql = (q[..., [0, 1], :] & 0xF) | ((q[..., [2, 3], :] & 0xF) << 4)  # [.., half, 2, 32]: ql[l], ql[l + 32]
    qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(*x.shape[:2], 128), qh.reshape(*x.shape[:2], 64), sc.view(np.uint8),
                             d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)


def _ratio(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """round(values / unit) in 0..top, 0 where the unit is 0."""
    unit32 = unit.astype(np.float32)[..., None]
    return np.clip(np.rint(values / np.where(unit32 > 0, unit32, 1)), 0, top).astype(np.uint8)


K_QUANTIZERS = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q6_K: quantize_q6_k}


def requantize(source: Path, out: Path, choose: QuantChoice) -> Path:
    """A copy of a float GGUF with each 2-D weight in the type `choose(name, values)` picks (F32 kept as is),
    quantized here: llama.cpp's `llama-quantize` is a C build these tests do without."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    writer = GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        values = np.array(tensor.data, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        qtype = choose(tensor.name, values) if values.ndim == 2 else GGMLQuantizationType.F32
        if qtype in K_QUANTIZERS:
            data = K_QUANTIZERS[qtype](values)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            _add_tensor(writer, tensor.name, values, qtype, 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
