"""Gemma 3 and Qwen3 style tokenizers through llama.cpp's real converter: the tokenizer pagegate builds from
the GGUF gives transformers' ids, text, chat prompts and stop tokens for the Hugging Face folder."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import jinja2
import pytest

from pagegate.engine.loading.gguf_tokenizer import tokenizer_from_gguf
from pagegate.engine.loading.tokenizer import Tokenizer

from ..family_tokenizers import (
    GEMMA_CONTROL,
    GEMMA_SPECIAL,
    GEMMA_TURNS,
    GEMMA_VOCAB_SIZE,
    QWEN3_ADDED,
    QWEN3_BPE_SIZE,
    QWEN3_SPECIAL,
    convert_vocab,
    save_gemma_tokenizer,
    save_qwen3_tokenizer,
)

BASE = [
    "", "a", " ", "  ", "   ", "\n", "\n\n\n", "\t", "\t\t", "\r\n", " \n \t ", "Hello world!", "hello  world",
    "  leading spaces", "trailing spaces   ", "multiple   inner    spaces", "line one\nline two\n\nline four",
    "\tindented\ttabs\t", "    def f(x):\n        return x\n", "I'm sure they'll say we've won, don't you?",
    "2024", "1234567890", "3.14159", "1,000,000", "-42 +7", "0x1F 1e-9", "v2.0.1", "12345678901234567890123",
    "a  3", "x\t12", "42nd street", "½ ¼ ¾ ² ³", "٣٤٥", "①②③",
    "你好，世界", "今天天气很好。", "日本語のテキストです。", "한국어 문장", "Привет, мир!", "Γειά σου Κόσμε",
    "😀", "🎉👍🚀", "👩‍👩‍👧‍👦 family", "🇫🇷 flag", "👋🏽 wave", "a😀b", "❤️ heart",
    "café naïve façade résumé", "Ünïcödé ÀÉÎÕÜ", "Straße déjà vu", "ß ẞ ǅ ﬁ ℃ ™",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ℵ", "தமிழ் எழுத்து", "ภาษาไทย", "ᚠᚢᚦ runes", "\u00a0nbsp\u200bzero width\u3000",  # absent: bytes
    "SELECT * FROM t WHERE id = 1;", "<div class=\"x\">hi</div>", "a->b && c || !d", "x = {'a': [1, 2, 3]}",
    "#!/bin/bash\necho $HOME", "!!! ??? ... —–-", "“smart quotes” and ‘single’", "(parens) [brackets] {braces}",
    "MiXeD CaSe camelCase snake_case SCREAMING_SNAKE kebab-case",
    "The quick brown fox jumps over the lazy dog. The dog didn't care; it's 3 o'clock.",
]
GEMMA_SPECIAL_TEXTS = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>x<eos>", "a<end_of_turn>b",
    " <start_of_turn> spaced <end_of_turn> ", "<pad><mask><unk>", "<start_of_turn", "< end_of_turn>",
    "<0x41> ▁x [PAD5]",
]
QWEN3_SPECIAL_TEXTS = [
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more", "<|im_end|><|im_end|>",
    "<think>\nreasoning\n</think>\n\nanswer", "x <think> y", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<tool_response>\nok\n</tool_response>", "<|im_start|", "< |im_start|>",
]
# Decomposed accents: Qwen's tokenizer.json normalizes them (NFC); Gemma's keeps them.
NFD = [unicodedata.normalize("NFD", "café naïve Ünïcödé"), "e\u0301 a\u0308 n\u0303"]


def _variants(texts: list[str]) -> list[str]:
    return list(dict.fromkeys(texts + [" " + text for text in texts] + [text + "\n" for text in texts[::2]]))


@dataclass
class Family:
    folder: Path
    gguf: Path
    ours: Tokenizer  # built from the GGUF
    theirs: Any  # transformers' AutoTokenizer for the folder
    texts: list[str]
    nfc: bool  # the tokenizer normalizes text to NFC


def _metadata(path: Path) -> dict[str, Any]:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


def _family(folder: Path, save: Callable[[Path], None], config: Any, pre: str, texts: list[str],
            nfc: bool = False) -> Family:
    """Save the tokenizer and a config naming the architecture, convert, and load both sides."""
    from transformers import AutoTokenizer

    save(folder)
    config.save_pretrained(folder)
    path = convert_vocab(folder, folder.parent / f"{folder.name}.gguf", pre)
    return Family(folder, path, tokenizer_from_gguf(_metadata(path)), AutoTokenizer.from_pretrained(folder),
                  _variants(texts), nfc)


@pytest.fixture(scope="session")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Family:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=GEMMA_VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                              pad_token_id=0, eos_token_id=[1, 6], bos_token_id=2)
    config.architectures = ["Gemma3ForCausalLM"]
    return _family(tmp_path_factory.mktemp("gemma_tok") / "gemma", save_gemma_tokenizer, config, "",
                   BASE + GEMMA_SPECIAL_TEXTS + NFD)


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Family:
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=QWEN3_BPE_SIZE + len(QWEN3_SPECIAL) + len(QWEN3_ADDED), hidden_size=64,
                         intermediate_size=96, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=64, bos_token_id=QWEN3_BPE_SIZE, eos_token_id=QWEN3_BPE_SIZE + 2)
    config.architectures = ["Qwen3ForCausalLM"]
    return _family(tmp_path_factory.mktemp("qwen3_tok") / "qwen3", save_qwen3_tokenizer, config, "qwen2",
                   BASE + QWEN3_SPECIAL_TEXTS + NFD, nfc=True)


@pytest.fixture(params=["gemma", "qwen3"])
def family(request: pytest.FixtureRequest) -> Family:
    return request.getfixturevalue(request.param)


def test_gguf_ids_match_transformers(family: Family) -> None:
    assert len(family.texts) > 150
    bad = [(text, special) for text in family.texts for special in (True, False)
           if family.ours.encode(text, special) != family.theirs.encode(text, add_special_tokens=special)]
    assert bad == []


def test_decode_matches_transformers_and_round_trips(family: Family) -> None:
    ours, theirs = family.ours, family.theirs
    for text in family.texts:
        ids = theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), (text, skip)
    # "▁" decodes to a space, and Qwen's NFC composes accents, in transformers too
    expected = {text: unicodedata.normalize("NFC", text) if family.nfc else text
                for text in family.texts if "▁" not in text}
    assert [text for text, back in expected.items() if ours.decode(ours.encode(text, False), False) != back] == []
    assert family.nfc == any(back != text for text, back in expected.items())


def test_gemma_special_tokens(gemma: Family) -> None:
    names = (*GEMMA_SPECIAL, *GEMMA_CONTROL, *GEMMA_TURNS)
    assert [gemma.theirs.convert_tokens_to_ids(name) for name in names] == list(range(len(names)))
    assert [gemma.ours.encode(name, False) for name in names] == [[i] for i in range(len(names))]
    assert type(gemma.theirs).__name__ == "GemmaTokenizer" and len(gemma.theirs) == GEMMA_VOCAB_SIZE
    assert gemma.ours.vocab_size == GEMMA_VOCAB_SIZE and gemma.ours.bos_token_id == 2
    assert gemma.ours.encode("hi")[0] == 2 and gemma.ours.encode("hi", False)[0] != 2
    types = _metadata(gemma.gguf)["tokenizer.ggml.token_type"]
    assert types[:len(names)] == [3] * len(names)  # all control tokens, as in a converted Gemma 3


def test_gemma_falls_back_to_bytes(gemma: Family) -> None:
    ids = gemma.ours.encode("𝔘ஆ", add_special_tokens=False)  # neither is in the training corpus
    pieces = [gemma.theirs.convert_ids_to_tokens(i) for i in ids]
    assert len(ids) == 7 and all(piece.startswith("<0x") for piece in pieces), pieces
    assert gemma.ours.decode(ids) == "𝔘ஆ"


def test_qwen3_special_tokens(qwen3: Family) -> None:
    ids = [qwen3.theirs.convert_tokens_to_ids(name) for name in (*QWEN3_SPECIAL, *QWEN3_ADDED)]
    assert ids == list(range(QWEN3_BPE_SIZE, QWEN3_BPE_SIZE + len(ids)))
    assert [qwen3.ours.encode(name, False) for name in (*QWEN3_SPECIAL, *QWEN3_ADDED)] == [[i] for i in ids]
    assert type(qwen3.theirs).__name__ == "Qwen2Tokenizer"
    # Qwen3's config.json names a BOS (<|endoftext|>) that the GGUF keeps; it is never added, as in transformers
    assert qwen3.theirs.bos_token_id is None and qwen3.ours.encode("hi") == qwen3.ours.encode("hi", False)
    metadata = _metadata(qwen3.gguf)
    assert metadata["tokenizer.ggml.pre"] == "qwen2"
    types = metadata["tokenizer.ggml.token_type"]
    assert types[QWEN3_BPE_SIZE:] == [3] * len(QWEN3_SPECIAL) + [4] * len(QWEN3_ADDED)
    # <think> and <tool_call> are not special in Qwen3: decoding keeps them
    assert qwen3.ours.decode(qwen3.ours.encode("<|im_start|><think>x</think>")) == "<think>x</think>"


def test_eos_ids_include_the_turn_end(family: Family) -> None:
    """The GGUF names one EOS; like llama.cpp, generation also ends on <end_of_turn> / <|endoftext|>, so the
    stop ids are generation_config.json's."""
    import json

    expected = json.loads((family.folder / "generation_config.json").read_text())["eos_token_id"]
    assert sorted(family.ours.eos_token_ids) == sorted(expected)
    folder = Tokenizer.from_folder(family.folder)
    assert folder is not None and sorted(folder.eos_token_ids) == sorted(expected)
    assert family.ours.eos_token_ids[0] == family.theirs.eos_token_id


GEMMA_CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Hello  \n"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "你好 😀"}],
    [{"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
     {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": " two"}]}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {
                                               "type": "string"}}, "required": ["city"]}}}]
QWEN3_CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "<think>\nThey greet.\n</think>\n\nHello!"},
     {"role": "user", "content": "再见 👋"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "sunny"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "because"}],
]


def _chats_match(family: Family, chats: list[list[dict[str, Any]]], **extra: Any) -> None:
    for messages in chats:
        for generation in (True, False):
            theirs = family.theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                                       **extra)
            ours = family.ours.apply_chat_template(messages, add_generation_prompt=generation, **extra)
            assert ours == theirs, messages
            assert family.ours.encode_chat(ours) == family.theirs.encode(theirs, add_special_tokens=False)


def test_gemma_chat_template_matches_transformers(gemma: Family) -> None:
    _chats_match(gemma, GEMMA_CHATS)
    prompt = gemma.ours.apply_chat_template(GEMMA_CHATS[1])
    assert prompt == "<bos><start_of_turn>user\nYou are terse.\n\nHello<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.ours.encode_chat(prompt).count(2) == 1  # the template's BOS, not a second one


def test_gemma_chat_template_refuses_bad_alternation(gemma: Family) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        gemma.ours.apply_chat_template(messages)
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        gemma.theirs.apply_chat_template(messages, tokenize=False)


def test_qwen3_chat_template_matches_transformers(qwen3: Family) -> None:
    _chats_match(qwen3, QWEN3_CHATS)
    _chats_match(qwen3, QWEN3_CHATS, tools=TOOLS)
    _chats_match(qwen3, QWEN3_CHATS, enable_thinking=False)
    assert qwen3.ours.chat_template_takes_tools


def test_qwen3_enable_thinking_false_closes_an_empty_think(qwen3: Family) -> None:
    messages = QWEN3_CHATS[0]
    thinking = qwen3.ours.apply_chat_template(messages)
    direct = qwen3.ours.apply_chat_template(messages, enable_thinking=False)
    assert thinking.endswith("<|im_start|>assistant\n")
    assert direct == thinking + "<think>\n\n</think>\n\n"
