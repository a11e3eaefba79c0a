"""Architecture name -> model class; a new family is a new file and a line in FAMILIES."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pagegate import kernels
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.config import ModelConfig
from pagegate.engine.models.gemma import GemmaForCausalLM
from pagegate.engine.models.layers import RotaryEmbedding
from pagegate.engine.models.llama import LlamaForCausalLM
from pagegate.engine.models.phi3 import Phi3ForCausalLM
from pagegate.engine.parallel import SINGLE, TensorParallel

FAMILIES: dict[str, Callable[[ModelConfig, TensorParallel], CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                      tp: TensorParallel = SINGLE) -> CausalLM:
    """A model (this rank's slice of it) with uninitialised weights, ready for the loader to fill."""
    family = FAMILIES.get(config.architecture)
    if family is None:
        raise ModelLoadError(f"architecture {config.architecture} has no model class; known: {sorted(FAMILIES)}")
    with torch.device("meta"), _uninitialised():
        model = family(config, tp)
    _materialise(model, dtype, torch.device(device))
    model.tie_weights()  # _materialise gives each reference to a shared weight its own storage
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache()  # a non-persistent buffer: _materialise left it uninitialised
    model.use_kernels(kernels.AttentionOps(torch.device(device)))
    return model.eval().requires_grad_(False)


def _materialise(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Every parameter and buffer of a meta-device model as an uninitialised tensor on `device`, floating ones in
    `dtype` (what `.to(dtype).to_empty(device)` gives). NOTE: torch.empty, not to_empty: the first empty_like of a
    meta tensor imports sympy and ~480 more modules (0.35 s and 34 MB of an engine core, for nothing)."""
    def empty(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype, device=device)

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(empty(param), param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = empty(buffer)


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")


@contextmanager
def _uninitialised() -> Iterator[None]:
    """Modules built without their initialisers (the loader fills every weight). NOTE: on the meta device torch runs
    them through torch._refs, which imports torch._dynamo and with it triton: 66 MB resident in a CPU engine core
    for nothing. transformers' no_init_weights does the same."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
