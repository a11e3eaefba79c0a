"""Tiny random Hugging Face models and tokenizers saved into temporary folders, plus a paged-cache helper."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.layers import AttentionMetadata

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. Paged attention keeps the cache in blocks.",
    "你好，世界。日本語のテキストも少し。한국어 문장도.",
    "emoji 😀🎉👍 café naïve façade — “quotes” and ‘more’.",
    "def f(x):\n    return x * 2\n\nprint(f(21))",
    "Stop here. STOP. The end is near; the end is here.",
]


def hf() -> object:
    """transformers (a test dependency), imported only by the tests that compare against it."""
    import transformers

    return transformers


@dataclass
class SavedModel:
    path: Path
    hf_model: torch.nn.Module  # the transformers model that wrote the folder, float32, eval mode


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every weight (norms and biases too) random values, large enough that errors would show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


def save_hf_model(folder: Path, config: object, seed: int = 0, **save_kwargs: object) -> SavedModel:
    """Build a random transformers model for `config` and save_pretrained it into `folder`."""
    torch.manual_seed(seed)
    model = hf().AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(folder, **save_kwargs)
    return SavedModel(folder, model)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    config = hf().LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2)
    return save_hf_model(tmp_path_factory.mktemp("llama"), config, seed=1)


@pytest.fixture(scope="session")
def llama3_rope_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = hf().LlamaConfig(**TINY, rope_parameters=rope)
    return save_hf_model(tmp_path_factory.mktemp("llama3"), config, seed=2)


@pytest.fixture(scope="session")
def head_dim_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    """Llama whose head_dim (32) is not hidden_size / heads (16), with attention and MLP biases."""
    config = hf().LlamaConfig(**TINY, head_dim=32, attention_bias=True, mlp_bias=True)
    return save_hf_model(tmp_path_factory.mktemp("head_dim"), config, seed=3)


@pytest.fixture(scope="session")
def mistral_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    config = hf().MistralConfig(**TINY, sliding_window=5)
    return save_hf_model(tmp_path_factory.mktemp("mistral"), config, seed=4)


@pytest.fixture(scope="session")
def qwen2_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    """Qwen2 with q/k/v biases and tied embeddings (its checkpoint has no lm_head)."""
    config = hf().Qwen2Config(**TINY, tie_word_embeddings=True)
    return save_hf_model(tmp_path_factory.mktemp("qwen2"), config, seed=5)


@pytest.fixture(scope="session")
def sharded_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    config = hf().LlamaConfig(**TINY)
    return save_hf_model(tmp_path_factory.mktemp("sharded"), config, seed=6, max_shard_size="80KB")


@pytest.fixture(scope="session", params=["bfloat16", "float16"])
def half_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    """A Llama saved in bfloat16 or float16 (config.json's dtype says which); hf_model is in that dtype."""
    folder = tmp_path_factory.mktemp(request.param)
    saved = save_hf_model(folder, hf().LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2), seed=7)
    saved.hf_model.to(getattr(torch, request.param)).save_pretrained(folder)
    return saved


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory, bytelevel_tokenizer_dir: Path) -> SavedModel:
    """A Llama folder with the byte-level tokenizer, all as transformers writes them: the template goes
    to chat_template.jinja (not tokenizer_config.json), bos/eos to generation_config.json."""
    folder = tmp_path_factory.mktemp("chat_model")
    config = hf().LlamaConfig(**{**TINY, "vocab_size": 400}, bos_token_id=0, eos_token_id=1)
    saved = save_hf_model(folder, config, seed=8)
    hf().AutoTokenizer.from_pretrained(bytelevel_tokenizer_dir).save_pretrained(folder)
    return saved


def _train_bpe(tokenizer: object, special_tokens: list[str], vocab_size: int,
               **trainer_kwargs: object) -> None:
    from tokenizers import trainers

    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, **trainer_kwargs)
    tokenizer.train_from_iterator(CORPUS * 10, trainer)


@pytest.fixture(scope="session")
def bytelevel_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-style byte-level BPE: bos from tokenizer.json's post-processor, chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    folder = tmp_path_factory.mktemp("tok_bytelevel")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    _train_bpe(tok, specials, 400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", pair="<|begin|> $A <|begin|> $B", special_tokens=[("<|begin|>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin|>", "eos_token": "<|end|>",
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def metaspace_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-2-style sentencepiece BPE with byte fallback, template in chat_template.jinja."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    folder = tmp_path_factory.mktemp("tok_metaspace")
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    _train_bpe(tok, ["<unk>", "<s>", "</s>", *byte_tokens], 420, limit_alphabet=60)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>"]])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    data = json.loads(tok.to_str())  # byte tokens are ordinary vocabulary, not special added tokens
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in byte_tokens]
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    bos = {"__type": "AddedToken", "content": "<s>", "special": True}  # as transformers serialises it
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": bos,
              "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
              "legacy": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                                                "{{ m['content'] }}{% endfor %}")
    return folder


class PagedBatch:
    """Hand-built paged KV cache for tests: each sequence gets scattered pages in a shuffled pool."""

    def __init__(self, model: CausalLM, num_seqs: int, max_len: int, block_size: int = 4,
                 seed: int = 0) -> None:
        per_seq = math.ceil(max_len / block_size)
        num_blocks = num_seqs * per_seq + 3
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_size = block_size
        self.block_tables = order[: num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                          for _ in range(model.num_layers)]
        self.lens = [0] * num_seqs

    def step(self, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs for one forward that appends chunks[i] to sequence i (all sequences take part)."""
        ids, positions, slots, starts = [], [], [], [0]
        for seq, chunk in enumerate(chunks):
            for offset, token in enumerate(chunk):
                pos = self.lens[seq] + offset
                block = int(self.block_tables[seq, pos // self.block_size])
                ids.append(token)
                positions.append(pos)
                slots.append(block * self.block_size + pos % self.block_size)
            self.lens[seq] += len(chunk)
            starts.append(starts[-1] + len(chunk))
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=self.block_tables,
            seq_lens=torch.tensor(self.lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
        )
        return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), attn

    def last_rows(self, chunks: list[list[int]]) -> torch.Tensor:
        """Indices in the flat batch of each sequence's last token of this step."""
        return torch.tensor([len(c) for c in chunks]).cumsum(0) - 1
