"""The runner of a GGUF model whose every step is native, in a core that never imports torch (issue 57).

`pagegate serve --model X.gguf` on a CPU runs every step of a Llama-family model in C (cpu_decode) and samples its
plain rows in C (cpu_sample); the torch model around them was a container the native step read its weights from.
Here the weights go straight from the file into the C's arguments (loading/gguf_native.py: the same bytes, so the
same tokens), the KV pages are numpy arrays, and torch's ~220 MiB and ~1.2 s of imports stay out of the process.
What needs torch is imported when a request needs it (a penalty, a bias or a grammar: sampling/processors.py;
prompt logprobs): the core stays correct whatever comes, and lean for what most requests are.

The torch runner (runner.py) stays for everything else, and as the oracle: accelerators, Hugging Face folders,
LoRA, a draft model, tensor parallelism, images, a sentence encoder (--task embed), the KV tiers, auto-4 pages, a
model of several in one page budget, and PAGEGATE_KERNEL_BACKEND=reference.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagegate.config import EngineConfig, parse_bytes
from pagegate.core import BatchBuilder, BlockPool, BlockTables
from pagegate.engine.devices import device_kind
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.kv_sizing import GIB, check_fits
from pagegate.engine.loading import read_ahead
from pagegate.engine.loading.generation import GenerationDefaults
from pagegate.engine.loading.gguf_file import GGUFFile, is_gguf
from pagegate.engine.loading.gguf_native import ARCHITECTURES, load_native, rope_tables
from pagegate.engine.loading.gguf_tokenizer import tokenizer_from_gguf
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.pooling import pool_step
from pagegate.engine.scheduler import ScheduledBatch
from pagegate.engine.serves import GENERATIVE_POOLING, Serves
from pagegate.engine.step_parts import cut_step, sampled_rows, step_token_ids
from pagegate.kernels.dispatch import (
    decode_kernel,
    quant_kernel,
    requested_backend,
    sample_kernel,
)
from pagegate.kernels.page_codes import row_bytes

log = logging.getLogger(__name__)

FORMATS = ("int8", "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int4")  # what --kv-cache-dtype may be
DTYPES = ("auto", "float32", "float")  # the native step computes in float32


def preloaded_tokenizer(config: EngineConfig, elastic: bool = False) -> Tokenizer | None:
    """The tokenizer of the model `config` names, where it was read ahead and the native core will serve it (the
    runner takes what was read): known before the weights load."""
    if not runs_native(config, elastic) or config.model is None:
        return None
    return read_ahead.tokenizer_read(Path(config.model))


class NotNative(Exception):
    """The model is not one the native core computes (its family, or a shape the C refuses): the torch runner runs
    it."""


def runs_native(config: EngineConfig, elastic: bool = False) -> bool:
    """Whether `config` asks for nothing but what the native core serves (its model's family is checked when it
    loads: NotNative). Cheap and torch-free: runners.make_runner asks it before anything imports torch."""
    cache, spec = config.cache, config.speculative
    return (config.task == "generate" and config.pooling in (None, *GENERATIVE_POOLING) and config.model is not None
            and is_gguf(Path(config.model)) and device_kind(config.device) == "cpu" and config.dtype in DTYPES
            and config.quantization in (None, "gguf") and config.tensor_parallel_size == 1 and config.lora is None
            and (spec is None or spec.model is None) and config.mmproj is None and not elastic
            and cache.kv_offload_memory is None and cache.kv_cache_dir is None
            and cache.kv_cache_dtype in ("auto", *FORMATS) and requested_backend() == "auto"
            and None not in (decode_kernel(), quant_kernel(), sample_kernel()))


@dataclass(frozen=True)
class PageFormat:
    """The pages' format in every layer (what metrics and the start-up line read: kv_format.LayerFormats' face)."""

    name: str


class NativePages:
    """Per layer a (K, V) pair of uint8 arrays [pages, block_size, kv_heads, row bytes] in one format, and the CPU
    pages swap moves them to. Anonymous mappings: a page costs memory when it is first written (the torch runner's
    untouched_zeros)."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, row: int,
                 num_cpu_blocks: int) -> None:
        self.page_bytes = 2 * layers * block_size * kv_heads * row
        shape = (block_size, kv_heads, row)
        self.layers = [(_zeros((num_blocks, *shape)), _zeros((num_blocks, *shape))) for _ in range(layers)]
        self.cpu_layers = [(_zeros((num_cpu_blocks, *shape)), _zeros((num_cpu_blocks, *shape)))
                           for _ in range(layers if num_cpu_blocks else 0)]

    def copy(self, pairs: np.ndarray) -> None:
        """Copy-on-write: page src's bytes into page dst, for each (src, dst)."""
        if len(pairs):
            for pages in self.layers:
                for cache in pages:
                    cache[pairs[:, 1]] = cache[pairs[:, 0]]

    def swap_out(self, pairs: np.ndarray) -> None:
        """(device page, cpu page) pairs, device -> CPU."""
        self._move(self.layers, self.cpu_layers, pairs)

    def swap_in(self, pairs: np.ndarray) -> None:
        """(cpu page, device page) pairs, CPU -> device."""
        self._move(self.cpu_layers, self.layers, pairs)

    @staticmethod
    def _move(source: list, target: list, pairs: np.ndarray) -> None:
        if len(pairs):
            for (sk, sv), (tk, tv) in zip(source, target, strict=True):
                tk[pairs[:, 1]], tv[pairs[:, 1]] = sk[pairs[:, 0]], sv[pairs[:, 0]]


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    size = int(np.prod(shape))
    if not size:
        return np.zeros(shape, np.uint8)
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8).reshape(shape)


@dataclass
class _Step:
    """A step's arrays as step_parts.cut_step reads them."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    key_ends: np.ndarray | None = None


class NativeRunner:
    """ModelRunner's face for a model of the native core: loads it, sizes and allocates its pages, and runs each
    scheduled batch to the logits that sample (numpy arrays throughout)."""

    device = "cpu"
    vision = None
    processing = None
    lora = None
    draft = None
    tiers = None
    workers = None
    chunk_invariant = True  # every step on the native decoder, whose rows never depend on each other

    def __init__(self, config: EngineConfig) -> None:
        assert config.model is not None
        self.config, path = config, Path(config.model)
        self.serves = Serves(generate=True, pooling=config.pooling)  # embeddings from its hidden states too
        preloaded = read_ahead.take(path)
        gguf = preloaded.gguf if preloaded else GGUFFile(path)
        if gguf.arch not in ARCHITECTURES:
            raise NotNative(f"the native core does not compute {gguf.arch}")
        log.info("loading weights from %s into the native core%s", path, " (read ahead)" if preloaded else "")
        self.model_config = gguf.config
        self.model_name = config.served_model_name or path.name
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} is more than the model's "
                             f"{self.model_config.max_position_embeddings} positions (max_position_embeddings): "
                             f"give --max-model-len {self.model_config.max_position_embeddings} or less")
        try:
            self.tokenizer = (preloaded.tokenizer if preloaded  # lazy merges: a server's core only decodes
                              else tokenizer_from_gguf(gguf.metadata, lazy_merges=True))
        except (KeyError, ValueError) as error:
            raise ModelLoadError(f"cannot build the tokenizer of {path.name}: {error}") from error
        self.generation = GenerationDefaults(eos_token_ids=list(self.model_config.eos_token_ids))
        self.eos_token_ids = sorted(set(self.generation.eos_token_ids) | set(self.tokenizer.eos_token_ids))
        self.weights = preloaded.weights if preloaded else load_native(gguf)
        self.cos_sin, self.local_cos_sin = rope_tables(self.model_config, self.max_model_len)
        self._check_shape()
        log.info("loaded %s (%s, weights %.0f MiB) into the native core", path.name, self.model_config.architecture,
                 self.weights.weight_bytes / 2**20)
        self.kv_format = PageFormat("int8" if config.cache.kv_cache_dtype == "auto" else config.cache.kv_cache_dtype)
        m = self.model_config
        self.row = row_bytes(self.kv_format.name, m.head_dim)
        self.kv_bytes_per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * self.row
        self.kv_pages = f"{self.kv_format.name} pages, {self.kv_bytes_per_token:,} bytes a token"
        self.num_blocks, self.num_cpu_blocks = self._size_kv_cache()
        self.allocate_kv_cache()
        log.info("every step runs on the native core (no torch in this process)")
        self.builder: BatchBuilder | None = None

    def _check_shape(self) -> None:
        fmt = self.config.cache.kv_cache_dtype
        head_dim = self.model_config.head_dim
        if fmt == "int4" and (head_dim & (head_dim - 1) or head_dim > 256):
            raise ValueError(f"int4 pages rotate each head, which needs a power-of-two head size up to 256, not "
                             f"{head_dim}: choose int8 pages for this model")

    @property
    def block_bytes(self) -> int:
        """K and V of one page in every layer."""
        return self.config.cache.block_size * self.kv_bytes_per_token

    def _size_kv_cache(self) -> tuple[int, int]:
        cache = self.config.cache
        budget = parse_bytes(cache.kv_cache_memory if cache.kv_cache_memory is not None
                             else cache.default_cpu_kv_cache_memory)
        num_blocks = cache.num_kv_blocks or budget // self.block_bytes
        check_fits(num_blocks, cache.block_size, self.max_model_len, self.block_bytes)
        num_cpu_blocks = int(cache.swap_space * GIB) // self.block_bytes
        log.info("KV cache: %d pages of %d tokens (%d tokens), %s pages of %d bytes (%.3f GiB), %d CPU swap pages",
                 num_blocks, cache.block_size, num_blocks * cache.block_size, self.kv_format.name, self.block_bytes,
                 num_blocks * self.block_bytes / GIB, num_cpu_blocks)
        return num_blocks, num_cpu_blocks

    def allocate_kv_cache(self) -> None:
        """The KV pages and the decoder over them: at load, and again when a sleeping engine wakes."""
        m, w, cache = self.model_config, self.weights, self.config.cache
        self.kv_cache = NativePages(m.num_hidden_layers, self.num_blocks, cache.block_size, m.num_key_value_heads,
                                    self.row, self.num_cpu_blocks)
        layers = [(*spec[:6], k, v, *spec[6:], self.kv_format.name)
                  for spec, (k, v) in zip(w.layers, self.kv_cache.layers, strict=True)]
        kernel = decode_kernel()
        assert kernel is not None
        try:
            self.decoder: Any = kernel.DecodeModel(
                w.dims, self.cos_sin, w.final_norm, w.embed, w.lm_head, layers, local_cos_sin=self.local_cos_sin,
                activation=m.hidden_act, embed_scale=w.embed_scale, final_softcap=m.final_logit_softcap)
        except ValueError as error:  # a shape the C does not take (head size, group, odd widths)
            raise NotNative(str(error)) from error
        self.max_tokens: int = kernel.MAX_TOKENS

    def free_kv_cache(self, pool: BlockPool) -> None:
        """Sleep: the KV pages' memory goes back, the weights stay."""
        del self.decoder, self.kv_cache

    def bind(self, tables: BlockTables) -> None:
        """Write each step's inputs from the scheduler's block tables."""
        self.builder = BatchBuilder(tables, tables.max_seqs, self.config.scheduler.step_tokens)

    def execute(self, batch: ScheduledBatch) -> np.ndarray:
        """Logits [R, vocab] for each sequence whose last token was computed this step, in batch order: one row,
        and one more per token guessed for it (speculation)."""
        assert self.builder is not None, "bind() the scheduler's block tables first"
        seqs, counts = batch.seqs, batch.num_tokens
        block_tables, slots, positions, seq_lens, starts = self.builder.build([s.handle for s in seqs], counts)
        input_ids = step_token_ids(seqs, counts, len(slots))
        pages = self.kv_cache
        pages.swap_out(batch.pairs("swap_out"))
        pages.copy(batch.copies)
        pages.swap_in(batch.pairs("swap_in"))
        hidden = self._forward(_Step(input_ids, positions, slots, block_tables, seq_lens, starts))
        if any(s.request.scoring_prompt for s in seqs):
            self._score_prompts(seqs, counts, starts, hidden)
        if self.serves.pooling is not None:  # embedding requests' rows are pooled, not sampled
            pool_step(seqs, counts, starts, hidden, self.serves.pooling)
        last = sampled_rows(seqs, starts)
        if not last:
            return np.zeros((0, self.model_config.vocab_size), np.float32)
        return self.decoder.logits(hidden[last])

    def _forward(self, step: _Step) -> np.ndarray:
        """Final hidden states [T, hidden]; a step of more than max_tokens as consecutive calls."""
        forward = self.decoder.forward
        if len(step.input_ids) <= self.max_tokens:
            return forward(step.input_ids, step.positions, step.slot_mapping, step.block_tables, step.seq_lens,
                           step.query_start_loc)
        return np.concatenate([forward(*part) for (part, _), _ in cut_step(step, None, self.max_tokens)])

    def _score_prompts(self, seqs: list, counts: list[int], starts: np.ndarray, hidden: np.ndarray) -> None:
        """Prompt logprobs (echo), in torch: imported for the requests that ask for them."""
        import torch

        from pagegate.engine.sampling.prompt_logprobs import score_prompts

        def logits(rows: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(self.decoder.logits(rows.numpy()))

        score_prompts(seqs, counts, starts.tolist(), torch.from_numpy(hidden), logits)

    def close(self, graceful: bool = True, pool: BlockPool | None = None) -> None:
        """Nothing to end: no workers, no tiers."""
