"""The runner of `--task embed`: a sentence encoder (BERT) in place of the decoder, with the same face to the engine.

Embedding requests go through the same scheduler as generations (admission, batching, priorities, aborts), but the
encoder attends both ways, so it runs a sentence once its whole prompt is scheduled: earlier chunks of a long
prompt only reserve their place. It keeps no KV cache: its pages are the scheduler's bookkeeping alone (no tensor
behind them), sized so that every running sequence can hold a prompt of the longest length.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagegate.config import EngineConfig
from pagegate.core import BlockPool, BlockTables
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.encoder_loader import load_encoder
from pagegate.engine.loading.loader import GenerationDefaults, model_path, resolve_device
from pagegate.engine.models.bert import token_mask
from pagegate.engine.models.config import ModelConfig, RopeConfig
from pagegate.engine.scheduler import ScheduledBatch
from pagegate.engine.sequence import Sequence
from pagegate.engine.serves import Serves

if TYPE_CHECKING:
    from pagegate.engine.draft import DraftModel
    from pagegate.engine.kv_tiers import TierStack
    from pagegate.engine.lora.model import LoRAModel
    from pagegate.engine.tp_workers import WorkerGroup

log = logging.getLogger(__name__)

_DTYPES = {"auto": torch.float32, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EncoderRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size > 1 or config.speculative is not None or config.pooling is not None:
            raise ModelLoadError("--task embed runs one encoder on one device: no --tensor-parallel-size, "
                                 "--speculative-config or --pooling (the encoder's own pooling is used)")
        if config.dtype not in _DTYPES:
            raise ModelLoadError(f"--dtype {config.dtype!r}: the encoder takes {', '.join(_DTYPES)}")
        self.config = config
        self.device = resolve_device(config.device)
        self.workers: WorkerGroup | None = None
        self.draft: DraftModel | None = None
        self.tiers: TierStack | None = None  # an encoder keeps no KV pages
        self.lora: LoRAModel | None = None  # nor adapters
        path = model_path(config)
        log.info("loading the encoder from %s", path)
        loaded = load_encoder(path, _DTYPES[config.dtype], self.device)
        self.model, self.pipeline, self.tokenizer = loaded.model, loaded.pipeline, loaded.tokenizer
        bert = loaded.config
        self.model_config = ModelConfig("BertModel", bert.vocab_size, bert.hidden_size, bert.intermediate_size,
                                        bert.num_hidden_layers, bert.num_attention_heads, bert.num_attention_heads,
                                        bert.head_dim, bert.layer_norm_eps, RopeConfig(),
                                        bert.max_position_embeddings)
        self.model_name = config.served_model_name or path.name
        self.max_model_len = (config.scheduler.max_model_len or self.pipeline.max_seq_length
                              or bert.max_position_embeddings)
        if self.max_model_len > bert.max_position_embeddings:
            raise ModelLoadError(f"max_model_len={self.max_model_len} is more than the encoder's "
                                 f"{bert.max_position_embeddings} positions")
        self.generation = GenerationDefaults()
        self.eos_token_ids: list[int] = []
        self.serves = Serves(generate=False, pooling=self.pipeline.pooling)
        self.chunk_invariant = False  # no prefix hits, no chunks: an input runs whole
        self.images = self.processing = self.vision = None  # it takes no images
        block = config.cache.block_size
        self.num_blocks = config.cache.num_kv_blocks or config.scheduler.max_num_seqs * (-(-self.max_model_len
                                                                                           // block) + 1)
        self.num_cpu_blocks = 0
        self.kv_format, self.kv_bytes_per_token, self.kv_pages = None, 0, "no KV pages: an encoder"
        log.info("encoder %s: %d layers, %d dimensions, %s pooling%s, at most %d tokens a sentence",
                 self.model_name, bert.num_hidden_layers, bert.hidden_size, self.pipeline.pooling,
                 ", normalized" if self.pipeline.normalize else "", self.max_model_len)

    def bind(self, tables: BlockTables) -> None:
        """Nothing to build from the block tables: the encoder reads no pages."""

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Encode and pool every sentence whose whole prompt is now scheduled; no logits (nothing samples)."""
        done = [s for s in batch.seqs if s.pools and s.num_computed == len(s.token_ids)]
        if done:
            self.embed(done)
        return torch.zeros(0, self.model_config.vocab_size)

    def embed(self, seqs: list[Sequence]) -> None:
        """One padded encoder batch; each request's embedding as its sentence-transformers pipeline gives it."""
        lengths = torch.tensor([len(s.token_ids) for s in seqs])
        input_ids = torch.full((len(seqs), int(lengths.max())), self.model.config.pad_token_id, dtype=torch.long)
        for row, seq in enumerate(seqs):
            input_ids[row, :len(seq.token_ids)] = torch.tensor(seq.token_ids)
        lengths = lengths.to(self.device)
        hidden = self.model(input_ids.to(self.device), lengths)
        vectors = pool_tokens(hidden, lengths, self.pipeline.pooling).float()
        if self.pipeline.normalize:
            vectors = F.normalize(vectors, dim=-1)
        for seq, vector in zip(seqs, vectors.cpu(), strict=True):
            seq.request.embedding = vector

    def close(self, graceful: bool = True, pool: BlockPool | None = None) -> None:
        """Nothing runs beside the encoder."""


def pool_tokens(hidden: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """[B, L, hidden] token embeddings of padded sentences -> [B, hidden], as sentence-transformers' Pooling."""
    real = token_mask(lengths, hidden.shape[1])[..., None]
    if mode == "mean":
        return (hidden * real).sum(dim=1) / lengths[:, None].to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(~real, float("-inf")).max(dim=1).values
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    raise ValueError(f"unknown pooling {mode!r}")
