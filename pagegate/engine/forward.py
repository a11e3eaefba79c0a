"""One step on one rank: the step's page moves, then the forward pass (rank 0 and every worker run this)."""

from __future__ import annotations

import numpy as np
import torch

from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.layers import AttentionMetadata
from pagegate.engine.models.native import NativeDecoder
from pagegate.engine.parallel import StepInputs


@torch.inference_mode()
def forward(model: CausalLM, kv_cache: PagedKVCache, step: StepInputs,
            native: NativeDecoder | None = None) -> torch.Tensor:
    """Swap out, copy on write, swap in, then hidden states [T, hidden] of the step's tokens (on the native
    decoder when there is one and it takes the step)."""
    kv_cache.swap_out(step.swap_out)
    kv_cache.copy(step.copies)
    kv_cache.swap_in(step.swap_in)
    if native is not None and native.takes(step):
        return native.forward(step)
    device = model.device

    def tensor(array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    attn = AttentionMetadata(tensor(step.slot_mapping), tensor(step.block_tables), tensor(step.seq_lens),
                             tensor(step.query_start_loc), None if step.key_ends is None else tensor(step.key_ends))
    given = None if step.given is None else (tensor(step.given[0]).long(), step.given[1].to(device))
    return model(tensor(step.input_ids), tensor(step.positions), kv_cache.layers, attn, given)
