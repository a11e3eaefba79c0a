"""The embedded default model: present, small, a Llama that transformers loads, and it writes English.

The folder is made by scripts/train_default_model.py (a tiny Llama trained on the King James Bible).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

import pagegate

MODEL_DIR = Path(pagegate.__file__).parent / "engine" / "default_model"
MAX_FOLDER_BYTES = 25 * 1000 * 1000
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json")
BOS, EOS, END = "<|begin_of_text|>", "<|end_of_text|>", "<|end|>"

# The 200 most frequent words of the King James Bible, lower case: 72% of its running words.
# A model that learned the text writes mostly these; a random one writes sub-word soup.
COMMON_WORDS = frozenset("""
the and of to that in he shall unto for i his a lord they be is him not them it with all thou thy
was god which my me said but ye their have will thee from as are when this out were upon man by
you israel king son up there hath then people came had house into on her come one we children
before your also s day land an so men against shalt if at let go hand us saying made went even no
do now behold saith therefore every these because after our things father down or sons hast o
david say make may over did earth what jesus she who great name thine among away any put thereof
forth give neither take am days city brought moses two heart pass judah jerusalem according
should whom know nor took thus bring offering good place word set more sent yet again like way
eat mine heard about called time evil egypt holy see own hundred spake heaven christ done
brethren many hear fathers fire saw words priest how thing years himself law thousand speak off
spirit voice eyes cast given servant art answered three together than
""".split())

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who made the heaven and the earth?"},
    {"role": "assistant", "content": "God made them."},
    {"role": "user", "content": "What does the Bible say about love?"},
]


def english_stats(text: str) -> tuple[list[str], float, float]:
    """(words, share of whitespace-separated chunks that are plain words, share of words in COMMON_WORDS)."""
    chunks = [c.strip(".,;:?!()'\"") for c in text.split()]
    chunks = [c for c in chunks if c]
    words = [c.lower() for c in chunks if c.isalpha()]
    alphabetic = len(words) / max(1, len(chunks))
    common = sum(w in COMMON_WORDS for w in words) / max(1, len(words))
    return words, alphabetic, common


@pytest.fixture(scope="module")
def transformers():
    import transformers

    return transformers


@pytest.fixture(scope="module")
def hf_tokenizer(transformers):
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model(transformers):
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def greedy(hf_model, hf_tokenizer, prompt: str, max_new_tokens: int) -> tuple[list[int], str]:
    """Greedy continuation of `prompt` (bos prepended), stopping at <|end_of_text|> or <|end|>."""
    import torch

    ids = torch.tensor([hf_tokenizer.encode(prompt)])
    stops = hf_tokenizer.convert_tokens_to_ids([EOS, END])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=stops, pad_token_id=stops[0])
    new = out[0, ids.shape[1]:].tolist()
    return new, hf_tokenizer.decode(new, skip_special_tokens=True)


def test_folder_is_complete_and_under_25_mb():
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert set(REQUIRED_FILES) <= names, f"missing: {set(REQUIRED_FILES) - names}"
    size = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert size <= MAX_FOLDER_BYTES, f"{size / 1e6:.1f} MB"


def test_config_is_a_small_llama_with_grouped_query_attention():
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["tie_word_embeddings"] is True
    vocab = json.loads((MODEL_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    assert config["vocab_size"] >= len(vocab)
    assert config["bos_token_id"] == vocab[BOS] and config["eos_token_id"] == vocab[EOS]
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert vocab[EOS] in generation["eos_token_id"] and vocab[END] in generation["eos_token_id"]


def test_transformers_loads_it_as_llama(hf_model):
    import torch

    assert type(hf_model).__name__ == "LlamaForCausalLM"
    num_params = sum(p.numel() for p in hf_model.parameters())
    assert 1_000_000 <= num_params <= 10_000_000
    assert all(p.dtype == torch.float32 for p in hf_model.parameters())


def test_transformers_and_tokenizers_encode_alike(hf_tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for text in ["And God said, Let there be light.", "  café 🙂\nnew line", "<|user|>\nhi<|end|>"]:
        ids = raw.encode(text).ids
        assert hf_tokenizer.encode(text) == ids
        assert ids[0] == raw.token_to_id(BOS) and ids.count(ids[0]) == 1  # bos once, first
        assert hf_tokenizer.decode(ids, skip_special_tokens=False) == BOS + text
    assert hf_tokenizer.bos_token == BOS and hf_tokenizer.eos_token == EOS


def test_greedy_continuation_is_english(hf_model, hf_tokenizer):
    _, text = greedy(hf_model, hf_tokenizer, "And God said", max_new_tokens=48)
    words, alphabetic, common = english_stats(text)
    assert len(words) >= 10, text
    assert alphabetic >= 0.9, text
    assert common >= 0.6, text
    assert len(set(words) & COMMON_WORDS) >= 6, text  # not one word repeated


def test_chat_template_renders_the_same_in_jinja2_and_transformers(hf_tokenizer):
    template = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    plain = jinja2.Environment().from_string(template).render(messages=MESSAGES, add_generation_prompt=True)
    hf_style = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    assert hf_style.render(messages=MESSAGES, add_generation_prompt=True) == plain
    assert hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == plain
    assert plain == ("<|system|>\nYou are a helpful assistant.<|end|>"
                     "<|user|>\nWho made the heaven and the earth?<|end|>"
                     "<|assistant|>\nGod made them.<|end|>"
                     "<|user|>\nWhat does the Bible say about love?<|end|>"
                     "<|assistant|>\n")
    without_prompt = hf_tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False)
    assert without_prompt.endswith("earth?<|end|>")


def test_chat_reply_is_english_and_ends_its_turn(hf_model, hf_tokenizer):
    prompt = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    new_ids, text = greedy(hf_model, hf_tokenizer, prompt, max_new_tokens=120)
    assert new_ids[-1] in hf_tokenizer.convert_tokens_to_ids([EOS, END]), text
    words, alphabetic, common = english_stats(text)
    assert len(words) >= 3 and alphabetic >= 0.9 and common >= 0.5, text
