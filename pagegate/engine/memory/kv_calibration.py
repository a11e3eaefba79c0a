"""auto-4 pages (issue 59): int8 in the quarter of layers where 4 bits cost most, int4 everywhere else.

Each layer's cost is measured once, at start-up, on a shipped public-domain text (calibration.txt, KJV Genesis 1;
not the text bench/kv_quality.py scores): the model's next-token distributions with float32 pages in every layer
are the reference, and a layer's cost is the mean KL divergence from them when that layer alone keeps int4 pages.
One forward a layer over CALIBRATION_TOKENS tokens, on the native decoder where the model has one.

NOTE: a quarter, not a byte budget: on SmolLM2 (30 layers) 7 int8 layers cost 7,464 bytes a token against uniform
int4's 6,120 and int8's 11,880, under the issue's 7.5 KB; the cost spreads evenly over SmolLM2's layers (measured),
so more int8 layers buy little per byte.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from pagegate.engine.forward import forward
from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.native import NativeDecoder
from pagegate.engine.parallel import StepInputs
from pagegate.kernels.kv_format import AUTO_4, FORMATS, KVFormat, LayerFormats

log = logging.getLogger(__name__)

TEXT = Path(__file__).with_name("calibration.txt")
CALIBRATION_TOKENS = 256
INT8_SHARE = 4  # one layer in this many keeps int8 pages
BLOCK = 16


def auto4_formats(model: CausalLM, token_ids: list[int]) -> LayerFormats:
    """auto-4's formats for `model`: int8 in the num_layers // INT8_SHARE layers that int4 costs most."""
    started = time.perf_counter()
    costs = layer_costs(model, token_ids[:CALIBRATION_TOKENS])
    keep = set(sorted(range(len(costs)), key=lambda i: -costs[i])[:len(costs) // INT8_SHARE])
    formats = tuple(FORMATS["int8"] if i in keep else FORMATS["int4"] for i in range(len(costs)))
    log.info("auto-4 pages: int8 in layers %s (int4 costs them most: KL %s nats a token), int4 in the other %d; "
             "calibrated in %.1fs", sorted(keep), ", ".join(f"{costs[i]:.4f}" for i in sorted(keep)),
             len(costs) - len(keep), time.perf_counter() - started)
    return LayerFormats(AUTO_4, formats)


@torch.inference_mode()
def layer_costs(model: CausalLM, token_ids: list[int]) -> list[float]:
    """Per layer: the mean KL divergence (nats a token) of the next-token distributions from float32 pages' when
    that layer alone has int4 pages."""
    reference = _log_probs(model, token_ids, [FORMATS["float32"]] * model.num_layers)
    costs = []
    for layer in range(model.num_layers):
        formats = [FORMATS["float32"]] * model.num_layers
        formats[layer] = FORMATS["int4"]
        trial = _log_probs(model, token_ids, formats)
        costs.append(float((reference.exp() * (reference - trial)).sum(-1).mean()))
    return costs


def _log_probs(model: CausalLM, token_ids: list[int], formats: list[KVFormat]) -> torch.Tensor:
    """Log-probabilities [T, vocab] after each token of one prompt prefilled into fresh pages of `formats`, on the
    native decoder where the model has one (as it will serve), else the torch forward."""
    n, pages = len(token_ids), -(-len(token_ids) // BLOCK)
    cache = PagedKVCache(model.num_layers, pages, BLOCK, model.num_kv_heads, model.head_dim,
                         LayerFormats("calibration", tuple(formats)), model.device)
    none = np.zeros((0, 2), np.int32)
    step = StepInputs(np.array(token_ids, np.int64), np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64),
                      np.arange(pages, dtype=np.int32)[None], np.array([n], np.int32), np.array([0, n], np.int32),
                      none, none, none)
    native = NativeDecoder.build(model, cache)
    hidden = forward(model, cache, step, native)
    return torch.log_softmax((native or model).compute_logits(hidden), -1)
