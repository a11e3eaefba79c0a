"""The model runner: loads the model (its tensor-parallel workers load their slices alongside), sizes and
allocates the KV pages, and turns each scheduled batch into tensors, a forward and the logits that sample."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from pagegate.config import EngineConfig
from pagegate.core import BatchBuilder, BlockPool, BlockTables
from pagegate.engine.draft import DraftModel
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.forward import forward
from pagegate.engine.image_step import ImageRows, encoder_dtype
from pagegate.engine.kv_cache import PagedKVCache, bytes_per_block, device_memory_budget
from pagegate.engine.kv_sizing import check_fits
from pagegate.engine.kv_tiers import TierStack
from pagegate.engine.loading.gguf_file import is_gguf
from pagegate.engine.loading.loader import load_checkpoint, model_path, resolve_device
from pagegate.engine.loading.mmproj import load_mmproj
from pagegate.engine.lora.model import LoRAModel
from pagegate.engine.media.processing import ImageProcessing, processing_from_folder
from pagegate.engine.media.prompt_images import VisionSpec
from pagegate.engine.memory.kv_calibration import TEXT as CALIBRATION_TEXT
from pagegate.engine.memory.kv_calibration import auto4_formats
from pagegate.engine.models.gemma3_vision import Gemma3Vision, load_gemma3_vision
from pagegate.engine.models.idefics3_vision import Idefics3Vision, load_idefics3_vision
from pagegate.engine.models.native import NativeDecoder
from pagegate.engine.parallel import SINGLE, StepInputs
from pagegate.engine.pooling import pool_step
from pagegate.engine.prefix_tiers import keep_asleep, move_tier_pages, write_down
from pagegate.engine.sampling.prompt_logprobs import score_prompts
from pagegate.engine.scheduler import ScheduledBatch
from pagegate.engine.serves import GENERATIVE_POOLING, Serves
from pagegate.engine.step_parts import sampled_rows, step_token_ids
from pagegate.engine.tier_setup import build_tiers, fingerprint
from pagegate.engine.tp_workers import WorkerGroup, rank_device
from pagegate.kernels.kv_format import AUTO_4, LayerFormats, resolve_format

log = logging.getLogger(__name__)

GIB = 1024**3
# a folder's image encoder, by family
VISION_LOADERS: dict[str, Callable[..., Idefics3Vision | Gemma3Vision]] = {"idefics3": load_idefics3_vision,
                                                                          "gemma3": load_gemma3_vision}
BIDIRECTIONAL_IMAGES = ("gemma3",)  # families whose image tokens see each other (a Gemma 3 image's whole run)


class ModelRunner:
    """Rank 0's runner: builds each step's inputs, sends them to the tensor-parallel workers (if any) and
    runs the same forward; only rank 0 computes logits."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.pooling is not None and config.pooling not in GENERATIVE_POOLING:
            raise ValueError(f"pooling must be one of {', '.join(GENERATIVE_POOLING)}, got {config.pooling!r}")
        self.serves = Serves(generate=True, pooling=config.pooling)
        self.device = resolve_device(config.device)
        self.workers: WorkerGroup | None = None
        self.tiers: TierStack | None = None
        if config.tensor_parallel_size > 1:  # the workers load their slices while this rank loads its own
            self.workers = WorkerGroup(config, self.device)
            self.device = rank_device(self.device, 0, config.tensor_parallel_size)
        try:
            self._load()
        except BaseException:
            self.close(graceful=False)  # the workers may wait for sizes that never come
            raise
        self.builder: BatchBuilder | None = None

    def _load(self) -> None:
        config, tp = self.config, self.workers.tp if self.workers is not None else SINGLE
        path = model_path(config)
        log.info("loading weights from %s", path)
        (self.model, self.model_config, self.generation), self.tokenizer = load_checkpoint(
            path, config.dtype, self.device, config.quantization, tp)
        self.model_name = config.served_model_name or (path.name if config.model else "pagegate-default")
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:  # its position tables end there
            raise ValueError(f"max_model_len={self.max_model_len} is more than the model's "
                             f"{self.model_config.max_position_embeddings} positions (max_position_embeddings): "
                             f"give --max-model-len {self.model_config.max_position_embeddings} or less")
        self.model.fit_context(self.max_model_len)
        self.eos_token_ids = sorted(set(self.generation.eos_token_ids) |
                                    set(self.tokenizer.eos_token_ids if self.tokenizer else ()))
        self.kv_format = self._page_formats()
        kv_shape = (self.model_config.num_key_value_heads, self.model.head_dim)
        self.kv_bytes_per_token = self.kv_format.bytes_per_token(*kv_shape)
        self.kv_pages = self.kv_format.describe(*kv_shape)
        self.num_blocks, self.num_cpu_blocks = self._size_kv_cache()
        self.allocate_kv_cache()
        spec = config.speculative
        self.draft = (DraftModel(spec.model, config, self.device, self.num_blocks, self.max_model_len,
                                 self.model_config.vocab_size) if spec is not None and spec.model else None)
        log.info("decode steps run on %s", "the native decoder" if self.native else "torch")
        self.tiers = self._tiers()
        self.lora = LoRAModel(self.model, config.lora, self.kv_cache.page_bytes) if config.lora else None
        self.processing: ImageProcessing | None = None  # a vision-language model's image preprocessing
        self.images = self._image_rows(path)

    def _image_rows(self, path: Path) -> ImageRows | None:
        """The image encoder of a vision-language model (None: a text-only one), on this rank alone: a Hugging Face
        folder's own, or a GGUF model's --mmproj file."""
        mmproj = self.config.mmproj
        if self.model_config.vision is None and mmproj is None:
            return None
        if self.workers is not None or self.draft is not None or self.config.lora is not None:
            raise ValueError("a vision-language model runs without tensor parallelism, a draft model or LoRA yet")
        if mmproj is None:
            family = self.model_config.vision
            assert family is not None
            self.processing = processing_from_folder(family, path)
            vision: Idefics3Vision | Gemma3Vision = VISION_LOADERS[family](path, device=self.device)
        else:
            if not is_gguf(path):
                raise ModelLoadError("--mmproj goes with a GGUF model file; a Hugging Face folder brings its own "
                                     "image encoder")
            vision, self.processing = load_mmproj(Path(mmproj), self.device)
            family = "gemma3" if isinstance(vision, Gemma3Vision) else "idefics3"
            self.model_config = replace(self.model_config, vision=family,
                                        image_token_id=self._special_token(self.processing.soft_token))
        if vision.config.text_hidden_size != self.model_config.hidden_size:
            raise ModelLoadError(f"the image encoder's rows are {vision.config.text_hidden_size} wide, the model's "
                                 f"embeddings {self.model_config.hidden_size}: they are not one model's")
        vision.compute_dtype = encoder_dtype(vision.stored_dtype, self.device)
        spec = VisionSpec(self.model_config.image_token_id or 0, vision.config.image_size, vision.config.image_seq_len,
                          bidirectional=self.model_config.vision in BIDIRECTIONAL_IMAGES)
        step_tokens, seqs = self.config.scheduler.step_tokens, self.config.scheduler.max_num_seqs
        if spec.bidirectional and step_tokens < spec.rows_per_tile + seqs - 1:
            # NOTE: beside every other sequence's decode, or the image could wait for a step with room forever
            raise ValueError(f"a {self.model_config.vision} image's {spec.rows_per_tile} tokens are computed in one "
                             f"step beside up to {seqs - 1} decodes: --max-num-batched-tokens must be at least "
                             f"{spec.rows_per_tile + seqs - 1}, not {step_tokens} (or lower --max-num-seqs)")
        log.info("image encoder: %s in %s, %.0f MiB of its output kept across requests", self.model_config.vision,
                 str(vision.compute_dtype).removeprefix("torch."), self.config.image_cache_memory / 2**20)
        return ImageRows(vision.encode, spec, self.config.image_cache_memory, self.processing.normalize)

    def _special_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False) if self.tokenizer is not None else []
        if len(ids) != 1:
            raise ModelLoadError(f"the model's vocabulary has no {text} token: is the --mmproj file this model's?")
        return ids[0]

    def _page_formats(self) -> LayerFormats:
        """Each layer's page format: --kv-cache-dtype's in every layer, or auto-4's calibrated mix."""
        name, m = self.config.cache.kv_cache_dtype, self.model
        fmt = resolve_format(name, m.dtype, self.device)
        if name != AUTO_4:
            return LayerFormats.uniform(fmt, m.num_layers)
        if m.tp.size > 1:
            raise ValueError("auto-4 pages are calibrated on one rank: choose int4 or int8 pages with tensor "
                             "parallelism")
        text = CALIBRATION_TEXT.read_text(encoding="utf-8")
        ids = self.tokenizer.encode(text) if self.tokenizer else list(text.encode())  # bytes: a tokenizer-less model
        return auto4_formats(m, [i % self.model_config.vocab_size for i in ids])

    def allocate_kv_cache(self) -> None:
        """The KV pages and the native decoder over them: at load, and again when a sleeping engine wakes."""
        m, cache = self.model, self.config.cache
        self.kv_cache = PagedKVCache(m.num_layers, self.num_blocks, cache.block_size, m.num_kv_heads, m.head_dim,
                                     self.kv_format, self.device, self.num_cpu_blocks)
        self.native = NativeDecoder.build(m, self.kv_cache)  # None: every step runs the torch forward

    @property
    def block_bytes(self) -> int:
        """K and V of one page in every layer, on this rank."""
        m = self.model
        return bytes_per_block(self.config.cache.block_size, m.num_kv_heads, m.head_dim, self.kv_format)

    def free_kv_cache(self, pool: BlockPool) -> None:
        """Sleep: the KV pages' memory (device and swap) goes back, the weights stay; with KV tiers, the pool's cached
        pages go down them first, so a woken engine finds its prefixes there. Refused where something else holds
        pages of this pool (tensor-parallel ranks, a draft model)."""
        if self.workers is not None or self.draft is not None:
            raise ValueError("sleep does not combine with tensor parallelism or a draft model yet")
        if self.tiers is not None:
            keep_asleep(self.kv_cache, self.tiers, pool)
        self.native = None
        del self.kv_cache

    def _tiers(self) -> TierStack | None:
        cache = self.config.cache
        if cache.kv_offload_memory is None and cache.kv_cache_dir is None:
            return None
        if self.workers is not None or self.draft is not None:
            raise ValueError("the KV tiers (--kv-offload-memory, --kv-cache-dir) do not combine with tensor "
                             "parallelism or a draft model yet")
        print_ = fingerprint(self.model, self.model_config, self.tokenizer, cache.block_size, self.kv_format)
        return build_tiers(cache, self.kv_cache.page_bytes, print_)

    def _size_kv_cache(self) -> tuple[int, int]:
        """Device and CPU pages: a byte budget (KV memory, swap space) is shared by the ranks, each of which
        holds its KV heads of every page; a GPU's own memory budget is per GPU."""
        cache, m, ranks = self.config.cache, self.model, self.model.tp.size
        block_bytes = bytes_per_block(cache.block_size, m.num_kv_heads, m.head_dim, self.kv_format)
        shared = ranks if self.device.type == "cpu" or cache.kv_cache_memory is not None else 1
        num_blocks = cache.num_kv_blocks or self._profiled_budget() // shared // block_bytes
        check_fits(num_blocks, cache.block_size, self.max_model_len, block_bytes)
        num_cpu_blocks = int(cache.swap_space * GIB) // ranks // block_bytes
        if self.workers is not None:
            self.workers.share_sizes(num_blocks, num_cpu_blocks)
        log.info("KV cache: %d pages of %d tokens (%d tokens), %s pages of %d bytes per rank (%.3f GiB), "
                 "%d CPU swap pages; %d rank(s) of %d KV heads each (%d in the model)",
                 num_blocks, cache.block_size, num_blocks * cache.block_size, self.kv_format.name, block_bytes,
                 num_blocks * block_bytes / GIB, num_cpu_blocks, ranks, m.num_kv_heads,
                 self.model_config.num_key_value_heads)
        return num_blocks, num_cpu_blocks

    def _profiled_budget(self) -> int:
        """Device bytes for pages; on CUDA after a forward at the largest batch (its peak is not KV)."""
        peak = 0
        if self.device.type == "cuda" and self.config.cache.kv_cache_memory is None:
            torch.cuda.reset_peak_memory_stats(self.device)
            scheduler = self.config.scheduler
            self.model.profile_forward(scheduler.step_tokens, scheduler.max_num_seqs)
            peak = torch.cuda.max_memory_allocated(self.device)
        return device_memory_budget(self.config.cache, self.device, peak)

    @property
    def vision(self) -> VisionSpec | None:
        """What intake checks of a prompt's images (None: the model takes none)."""
        return self.images.spec if self.images is not None else None

    @property
    def chunk_invariant(self) -> bool:
        """Whether a token's arithmetic is the same whatever step it rides in, however its prompt was chunked: every
        step runs on the native decoder (LoRA rows too), whose rows never depend on each other (cpu_decode.h)."""
        return self.native is not None and (self.lora is None or self.lora.table is not None)

    def bind(self, tables: BlockTables) -> None:
        """Write each step's inputs from the scheduler's block tables."""
        self.builder = BatchBuilder(tables, tables.max_seqs, self.config.scheduler.step_tokens)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [R, vocab] for each sequence whose last token was computed this step, in batch order: one row,
        and one more per token guessed for it (speculation)."""
        assert self.builder is not None, "bind() the scheduler's block tables first"
        seqs, counts = batch.seqs, batch.num_tokens
        block_tables, slots, positions, seq_lens, starts = self.builder.build([s.handle for s in seqs], counts)
        input_ids = step_token_ids(seqs, counts, len(slots))
        given = key_ends = None
        if self.images is not None:
            given = self.images.given(seqs, counts, starts)
            key_ends = self.images.key_ends(seqs, counts, starts, positions)
        step = StepInputs(input_ids, positions, slots, block_tables, seq_lens, starts,
                          batch.pairs("swap_out"), batch.copies, batch.pairs("swap_in"), given, key_ends)
        if self.workers is not None:
            self.workers.channel.send(step)
        # NOTE: every step runs on the native decoder where there is one, prefill included: its arithmetic is the
        # same for a token whatever step it rides in (cpu_decode.h), so a prefix hit's tail writes the K/V a cold
        # prefill did, and warm = cold needs no torch path.
        if self.tiers is not None:  # before anything writes the step's new pages
            move_tier_pages(self.kv_cache, self.tiers, batch.evicted, batch.tier_loads)
        # NOTE: a step with LoRA adapters' rows stays on the native decoder where the adapters sit in its C table
        # (lora/model.py); elsewhere the torch forward's hooks add their updates.
        lora_groups = self.lora.set_step([s.request.lora_name for s in seqs], starts) if self.lora else None
        native = self.native
        if native is not None:
            native = native.take_adapters(self.lora.table if self.lora else None, lora_groups)
        hidden = forward(self.model, self.kv_cache, step, native)
        compute_logits = (self.native or self.model).compute_logits
        if any(s.request.scoring_prompt for s in seqs):
            score_prompts(seqs, counts, starts.tolist(), hidden, compute_logits)
        if self.serves.pooling is not None:  # embedding requests' rows are pooled, not sampled
            pool_step(seqs, counts, starts, hidden, self.serves.pooling)
        last = sampled_rows(seqs, starts)
        if not last:
            return hidden.new_zeros(0, self.model_config.vocab_size, dtype=torch.float32)
        return compute_logits(hidden[last])

    def close(self, graceful: bool = True, pool: BlockPool | None = None) -> None:
        """End the tensor-parallel workers; write the pool's cached pages (`pool`) down the KV tiers."""
        if self.tiers is not None:
            if graceful and pool is not None:
                write_down(self.kv_cache, self.tiers, pool)
            self.tiers.close()
            self.tiers = None
        if self.workers is not None:
            self.workers.close(graceful=graceful)
            self.workers = None

