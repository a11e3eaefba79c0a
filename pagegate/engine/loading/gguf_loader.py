"""Fill a torch model from a GGUF file (gguf_file.py reads it): matrices kept in their blocks where the CPU kernels
read them, every other tensor dequantized into its parameter."""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.gguf_file import NOT_WEIGHTS, GGUFFile, hf_name
from pagegate.engine.loading.layout import checkpoint_layout
from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.quantized import QuantEmbedding, QuantLinear, QuantLinearStack


def keep_blocks(gguf: GGUFFile, model: CausalLM, block_types: frozenset[int]) -> None:
    """Swap each linear layer (and the embedding) whose weights are all of one type in `block_types` for one that
    keeps the file's blocks; load_weights then skips those tensors."""
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Embedding | nn.Linear):
            continue
        parent = path.rsplit(".", 1)[0]
        names = [f"{parent}.{shard}.weight" for shard in getattr(module, "shard_names", ())] or [f"{path}.weight"]
        if gguf.has(f"{path}.weight"):  # a projection the file keeps fused (Phi-3)
            names = [f"{path}.weight"]
        parts = gguf.matrix_parts(names, block_types)
        if parts is not None:  # None: a tied lm_head has no tensor of its own
            model.set_submodule(path, _block_module(module, [(torch.from_numpy(blocks), qtype)
                                                             for blocks, qtype in parts]))
    gguf.blocks_written()
    embedding = model.model.embed_tokens
    if model.config.tie_word_embeddings and isinstance(embedding, QuantEmbedding):
        model.lm_head = embedding.as_linear()


def load_weights(gguf: GGUFFile, model: CausalLM) -> None:
    """Dequantize every tensor not kept in blocks into the parameter the model's layout maps it to."""
    layout = checkpoint_layout(model)
    expected = set(layout)
    for tensor in tqdm(gguf.reader.tensors, desc="dequantizing", unit="tensor", disable=None):
        if tensor.name in NOT_WEIGHTS or tensor.name in gguf.kept:
            continue
        whole = torch.from_numpy(gguf.array(tensor.name))
        for name, values in model.unfused(hf_name(tensor.name, gguf.arch), whole):
            if name not in layout:
                raise ModelLoadError(f"unexpected tensor {tensor.name} in {gguf.path.name}")
            param, start, rows, source = layout[name]
            values = gguf.unpermuted(name, values)[source]  # whole heads first, then a rank's
            if tuple(values.shape) != (rows, *param.shape[1:]):
                raise ModelLoadError(f"tensor {tensor.name} has shape {tuple(values.shape)}, the model "
                                     f"expects {(rows, *param.shape[1:])}")
            param.data[start:start + rows].copy_(values)
            expected.discard(name)
        gguf.reader.release(tensor)
    if expected:
        raise ModelLoadError(f"{gguf.path.name} is missing tensor(s): {', '.join(sorted(expected)[:5])}")


def _block_module(module: nn.Embedding | nn.Linear, parts: list[tuple[torch.Tensor, int]]) -> nn.Module:
    """The block-keeping replacement of an nn.Embedding or a (packed) nn.Linear: its matrix, or its matrices of
    different types one after the other."""
    dtype = module.weight.dtype
    if isinstance(module, nn.Embedding):
        [(blocks, qtype)] = parts
        return QuantEmbedding(blocks, qtype, module.embedding_dim, dtype)
    names, sizes, bias = getattr(module, "shard_names", ()), getattr(module, "shard_sizes", ()), module.bias is not None
    if len(parts) == 1:
        [(blocks, qtype)] = parts
        return QuantLinear(blocks, qtype, module.in_features, dtype, names, sizes, bias=bias)
    linears = [QuantLinear(blocks, qtype, module.in_features, dtype) for blocks, qtype in parts]
    return QuantLinearStack(linears, names, sizes, bias=bias)
