"""The tokenizer built from GGUF metadata, against transformers' GGUF tokenizer and llama.cpp's rules.

Where transformers departs from llama.cpp (the tokenizer the GGUF's model runs under, and the one it was
trained with), the tests follow llama.cpp and say so.
"""

from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Regex, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from pagegate.engine.loading.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf
from pagegate.engine.loading.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

BASE_TEXTS = [
    "", "a", "A", "ab", " ", "  ", "\n", "\n\n\n", "\t", "\r\n", "Hello world!", "hello world", "HELLO WORLD",
    "Hello, World.", "  two leading spaces", "trailing spaces   ", "\t\tindented\ttabs", "a\r\nb\r\n",
    "line one\nline two\n\nline four", "  a  b  c  ", "mixed   runs \t\n of \n\n\n  whitespace",
    "I'm", "you're", "they'll", "we've", "she'd", "it's", "don't", "I'M SHOUTING", "YOU'RE", "They'LL",
    "rock 'n' roll", "'quoted'", "2024", "1234567890", "3.14159", "1,000,000", "-42", "+7", "0x1F", "1e-9",
    "42nd street", "v2.0.1", "ISBN 978-3-16-148410-0", "  2024", "a  3", "x\t12", "year 1999 and 2000",
    "½ ¼ ¾", " ² ³", "٣٤٥ Arabic-Indic digits", "Ⅻ roman", "①②③", "3rd 21st 100th",
    "123456789012345678901234567890",
    "你好，世界", "日本語のテキストです。", "한국어 문장", "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم",
    "שלום עולם", "हिन्दी पाठ", "ภาษาไทย", "café naïve façade", "Ünïcödé ÀÉÎÕÜ", "ß ẞ ǅ ﬁ", "Ⅰ Ⅱ ℃ ™",
    "😀", "🎉👍", "👩‍👩‍👧‍👦 family", "🇫🇷 flag", "👋🏽 wave", "a😀b", "emoji 😀 in text 🚀!",
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '<div class="x">hi</div>',
    "SELECT * FROM t WHERE id = 1;", "x = {'a': [1, 2, 3]}", "#!/bin/bash\necho $HOME", "a->b && c || !d",
    "λx. x + 1", "print('hello')  # comment", "    indented code\n        deeper\n", "!!!", "???", "...",
    "—–-", "“smart quotes” and ‘single’", "(parens) [brackets] {braces}", "a/b\\c",
    "@user #tag $100 %50 ^up &and *star", "~tilde `backtick` |pipe|", "<>=+", "hello!! world??",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more", "<|im_end|><|im_end|>", "<|im_start|", "< |im_start|>", "x <|im_end|> y",
    "MiXeD CaSe WoRdS", "camelCaseIdentifier", "snake_case_identifier", "SCREAMING_SNAKE", "kebab-case-word",
    "word\u00a0nbsp", "zero\u200bwidth", "tab\tand\vvertical\fform", "\u3000ideographic space",
    "The quick brown fox jumps over the lazy dog. The dog didn't care; it's 3 o'clock.",
]
# Every base text, also with a leading space and (every other one) a trailing newline: 200+ strings.
TEXTS = list(dict.fromkeys(BASE_TEXTS + [" " + text for text in BASE_TEXTS] +
                           [text + "\n" for text in BASE_TEXTS[::2]]))


def _has_number(text: str) -> bool:
    return any(unicodedata.category(char).startswith("N") for char in text)


def _mismatches(ours: Tokenizer, theirs: Any, texts: Iterable[str]) -> list[tuple[str, bool]]:
    """(text, add_special_tokens) pairs where the token ids differ."""
    return [(text, special) for text in texts for special in (True, False)
            if ours.encode(text, special) != theirs.encode(text, add_special_tokens=special)]


def _round_trips(tokenizer: Tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False) == text


def _surfaces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [tokenizer.token_text(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def _read_metadata(path: Path) -> dict[str, Any]:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


def _auto_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer  # a test-only dependency

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ----------------------------------------------------------------------------------------------------
# The real SmolLM2 file (tokenizer.ggml.pre = smollm)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return tokenizer_from_gguf(_read_metadata(smollm2_gguf))


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf: Path) -> Any:
    return _auto_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_hf_digits(smollm2_hf: Any) -> HFTokenizer:
    """transformers' SmolLM2 backend with the pre-tokenizer of SmolLM2's own tokenizer.json put back.

    transformers has no `smollm` entry in GGUF_PRE_TOKENIZER_SPLITS, so it splits with the bare GPT-2
    regex. llama.cpp (and SmolLM2's tokenizer.json: Digits(individual_digits=True) + ByteLevel) first
    cuts every \\p{N} character off on its own. The vocabulary has no multi-digit tokens, so this only
    shows around numbers: "a  3" is a, ĠĠ, 3 for llama.cpp and a, Ġ, Ġ, 3 for transformers; " ½" is
    Ġ, Â½ against ĠÂ, ½.
    """
    backend = HFTokenizer.from_str(smollm2_hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return backend


def test_texts_are_many_and_varied() -> None:
    assert len(TEXTS) >= 200
    assert sum(map(_has_number, TEXTS)) >= 30 and sum(not _has_number(text) for text in TEXTS) >= 150


def test_smollm2_matches_transformers_on_texts_without_numbers(smollm2: Tokenizer, smollm2_hf: Any) -> None:
    assert _mismatches(smollm2, smollm2_hf, [text for text in TEXTS if not _has_number(text)]) == []


def test_smollm2_matches_transformers_with_digits_split(smollm2: Tokenizer,
                                                        smollm2_hf_digits: HFTokenizer) -> None:
    bad = [(text, special) for text in TEXTS for special in (True, False)
           if smollm2.encode(text, special) != smollm2_hf_digits.encode(text, add_special_tokens=special).ids]
    assert bad == []


def test_smollm2_splits_digits_like_llama_cpp(smollm2: Tokenizer) -> None:
    assert _surfaces(smollm2, "2024") == ["2", "0", "2", "4"]
    assert _surfaces(smollm2, " 12345") == [" ", "1", "2", "3", "4", "5"]
    assert _surfaces(smollm2, "a  3") == ["a", "  ", "3"]  # transformers: a, " ", " ", 3


def test_smollm2_decode_round_trips(smollm2: Tokenizer, smollm2_hf: Any) -> None:
    assert [text for text in TEXTS if not _round_trips(smollm2, text)] == []
    for text in TEXTS:
        ids = smollm2.encode(text)
        assert smollm2.decode(ids) == smollm2_hf.decode(ids, skip_special_tokens=True), text


def test_smollm2_special_tokens_and_chat_template(smollm2: Tokenizer) -> None:
    assert smollm2.special_tokens["bos_token"] == "<|im_start|>" and smollm2.bos_token_id == 1
    # <|endoftext|> (0) ends generation too, as llama.cpp's end-of-generation list has it
    assert smollm2.special_tokens["eos_token"] == "<|im_end|>" and smollm2.eos_token_ids == [2, 0]
    assert smollm2.special_tokens["unk_token"] == "<|endoftext|>"
    assert smollm2.vocab_size == 49152
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")
    ids = smollm2.encode(prompt)  # add_bos_token is false in the file: nothing is added
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert smollm2.encode("hi") == smollm2.encode("hi", add_special_tokens=False)
    assert smollm2.decode(ids) == prompt.replace("<|im_start|>", "").replace("<|im_end|>", "")


# ----------------------------------------------------------------------------------------------------
# Small GGUF files written here, over vocabularies trained here


def _corpus() -> list[str]:
    """A few hundred varied lines: prose, made-up words, numbers, code, whitespace runs, other scripts."""
    rng = random.Random(0)
    words = ("the quick brown fox jumps over lazy dog paged attention cache block token model server "
             "request stream batch memory page table sequence kernel I'm it's they'll we've don't "
             "Hello World MIXED Case café naïve façade 你好 世界 日本語 한국어 Привет мир λ").split()
    syllables = "ka lo mi ne su ra te vo chi ban dor el ing tion pre str ow".split()
    words += ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(300)]
    words += [word.capitalize() for word in words[::5]] + [word.upper() for word in words[::11]]
    code = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
            "if a->b && !c: print('ok')  # done", "<div class=\"x\">hi</div>", "x = {'a': [1, 2]}"]
    lines = []
    for _ in range(500):
        parts = [rng.choice(words) if rng.random() < 0.85 else str(rng.randint(0, 10 ** rng.randint(1, 7)))
                 for _ in range(rng.randint(3, 12))]
        line = rng.choice([" ", "  ", " ", ", ", "\t"]).join(parts) + rng.choice([".", "!", "?", "", "\n"])
        lines.append(line if rng.random() < 0.85 else rng.choice(code))
    return lines + ["emoji 😀🎉👍 🚀 ½ 3.14159 1,000,000", "    indented\n        deeper\n\n\n"]


def _trained(model: BPE, normalizer: Any, pre_tokenizer: Any, trainer: trainers.BpeTrainer) -> dict[str, Any]:
    backend = HFTokenizer(model)
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.train_from_iterator(_corpus(), trainer)
    return json.loads(backend.to_str())["model"]


@pytest.fixture(scope="module")
def byte_level_vocab() -> dict[str, Any]:
    """A trained byte-level BPE: 3 control tokens, then the byte alphabet and merges, then `<think>`."""
    model = _trained(BPE(), None, pre_tokenizers.ByteLevel(add_prefix_space=False),
                     trainers.BpeTrainer(vocab_size=1200, special_tokens=SPECIAL, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokens = sorted(model["vocab"], key=model["vocab"].get) + ["<think>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL) - 1) + [4],
            "tokenizer.ggml.merges": [" ".join(merge) for merge in model["merges"]],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.chat_template": CHATML}


@pytest.fixture(scope="module")
def sentencepiece_vocab() -> dict[str, Any]:
    """A SentencePiece-style BPE: <unk> <s> </s>, the 256 <0xNN> bytes, `▁`-spelled pieces scored by
    merge order. The alphabet is capped, so rarer characters (CJK, emoji) fall back to bytes."""
    specials = ["<unk>", "<s>", "</s>"]
    model = _trained(BPE(unk_token="<unk>"),
                     normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                     pre_tokenizers.Metaspace(prepend_scheme="never"),
                     trainers.BpeTrainer(vocab_size=900, special_tokens=specials, limit_alphabet=80,
                                         show_progress=False))
    pieces = [piece for piece in sorted(model["vocab"], key=model["vocab"].get) if piece not in specials]
    tokens = specials + [f"<0x{byte:02X}>" for byte in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(rank) for rank in range(len(pieces))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.merges": [" ".join(merge) for merge in model["merges"]],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


_WRITERS = {
    "tokenizer.ggml.model": "add_tokenizer_model", "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list", "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges", "tokenizer.ggml.scores": "add_token_scores",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id", "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.ggml.eot_token_id": "add_eot_token_id", "tokenizer.ggml.eom_token_id": "add_eom_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token", "tokenizer.ggml.add_eos_token": "add_add_eos_token",
    "tokenizer.ggml.add_space_prefix": "add_add_space_prefix", "tokenizer.chat_template": "add_chat_template",
}


def _write_gguf(path: Path, metadata: dict[str, Any]) -> Path:
    """A GGUF holding only tokenizer metadata (and one tiny tensor)."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in metadata.items():
        getattr(writer, _WRITERS[key])(value)
    writer.add_tensor("token_embd.weight", np.zeros((1, 1), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pair(tmp_path_factory: pytest.TempPathFactory, name: str,
          metadata: dict[str, Any]) -> tuple[Tokenizer, Any]:
    """pagegate's tokenizer (from the file read back) and transformers' for the same GGUF."""
    path = _write_gguf(tmp_path_factory.mktemp(name) / f"{name}.gguf", metadata)
    return tokenizer_from_gguf(_read_metadata(path)), _auto_tokenizer(path)


@pytest.fixture(scope="module", params=["gpt-2", "qwen2", "llama-bpe"])
def byte_level_pair(request: pytest.FixtureRequest, byte_level_vocab: dict[str, Any],
                    tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    metadata = {**byte_level_vocab, "tokenizer.ggml.pre": request.param, "tokenizer.ggml.add_bos_token": True}
    return _pair(tmp_path_factory, request.param, metadata)


def test_byte_level_pre_types_match_transformers(byte_level_pair: tuple[Tokenizer, Any]) -> None:
    ours, theirs = byte_level_pair
    assert _mismatches(ours, theirs, TEXTS + ["x <think> y", "<think>\nok</think>"]) == []
    assert [text for text in TEXTS if not _round_trips(ours, text)] == []
    assert ours.encode("hi")[0] == 0 and ours.encode("hi", add_special_tokens=False)[0] != 0


# llama.cpp's `default` pre-tokenizer as llama-vocab.cpp lists it; transformers has no entry for it and
# falls back to the single GPT-2 regex, so the comparison puts these splits into its backend.
LLAMA_CPP_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+",
                     r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                     r"\p{N}+", "[0-9][0-9][0-9]"]


def test_default_pre_type_follows_llama_cpp(byte_level_vocab: dict[str, Any],
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    ours, theirs = _pair(tmp_path_factory, "default", {**byte_level_vocab, "tokenizer.ggml.pre": "default"})
    backend = HFTokenizer.from_str(theirs.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), "isolated") for split in LLAMA_CPP_DEFAULT] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert [text for text in TEXTS if ours.encode(text) != backend.encode(text).ids] == []
    assert [text for text in TEXTS if not _round_trips(ours, text)] == []
    # Tokens never cross llama.cpp's splits: digit runs go in threes, punctuation runs lose their space.
    assert "123" in _spelled_prefixes(_surfaces(ours, "12345"))
    assert "a " in _spelled_prefixes(_surfaces(ours, "a !!"))


def _spelled_prefixes(parts: list[str]) -> set[str]:
    """The texts spelled by the first 1, 2, ... tokens: the places a split may fall."""
    return {"".join(parts[:end]) for end in range(1, len(parts) + 1)}


def test_llama3_pre_type_ignores_merges_for_whole_tokens() -> None:
    """llama.cpp's llama3 pre-tokenizer takes a piece that is itself a token as is (ignore_merges)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [*alphabet, "ab", "abc"],
                "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.add_bos_token": False}
    llama3 = tokenizer_from_gguf({**metadata, "tokenizer.ggml.pre": "llama-bpe"})
    gpt2 = tokenizer_from_gguf({**metadata, "tokenizer.ggml.pre": "gpt-2"})
    assert _surfaces(llama3, "abc") == ["abc"] and _surfaces(gpt2, "abc") == ["ab", "c"]


def test_bos_defaults_follow_llama_cpp(byte_level_vocab: dict[str, Any],
                                      sentencepiece_vocab: dict[str, Any]) -> None:
    without_flag = {key: value for key, value in byte_level_vocab.items()
                    if key != "tokenizer.ggml.add_bos_token"}
    # llama.cpp adds BOS by default for the llama3 pre-tokenizer and for SentencePiece, not for GPT-2 splits.
    assert tokenizer_from_gguf({**without_flag, "tokenizer.ggml.pre": "llama-bpe"}).encode("hi")[0] == 0
    assert tokenizer_from_gguf({**without_flag, "tokenizer.ggml.pre": "gpt-2"}).encode("hi")[0] != 0
    assert tokenizer_from_gguf(sentencepiece_vocab).encode("hi")[0] == 1
    flags = {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}
    spm = tokenizer_from_gguf({**sentencepiece_vocab, **flags})
    assert spm.encode("hi")[-1] == 2 and spm.encode("hi")[0] != 1
    assert spm.encode("hi", add_special_tokens=False)[-1] != 2


def test_special_tokens_eos_ids_and_template(byte_level_vocab: dict[str, Any]) -> None:
    tokenizer = tokenizer_from_gguf({**byte_level_vocab, "tokenizer.ggml.pre": "qwen2",
                                     "tokenizer.ggml.eot_token_id": 2, "tokenizer.ggml.eom_token_id": 0})
    assert tokenizer.eos_token_ids == [2, 0]
    assert tokenizer.special_tokens["bos_token"] == "<|endoftext|>"
    assert tokenizer.special_tokens["pad_token"] == "<|endoftext|>"
    assert tokenizer.special_tokens["unk_token"] is None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert prompt == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    think = len(byte_level_vocab["tokenizer.ggml.tokens"]) - 1
    assert tokenizer.encode("a<think>b", add_special_tokens=False).count(think) == 1
    assert tokenizer.decode(tokenizer.encode("<|im_start|>x<think>")) == "x<think>"  # control tokens skipped


# ----------------------------------------------------------------------------------------------------
# SentencePiece (`llama`) vocabularies

SPM_TEXTS = [text for text in TEXTS if not any(special in text for special in SPECIAL)]


@pytest.fixture(scope="module", params=["scores", "merges"])
def sentencepiece_pair(request: pytest.FixtureRequest, sentencepiece_vocab: dict[str, Any],
                       tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """Merges derived from the scores (the usual llama GGUF), or written into the file."""
    metadata = dict(sentencepiece_vocab)
    if request.param == "scores":
        del metadata["tokenizer.ggml.merges"]
    return _pair(tmp_path_factory, f"spm-{request.param}", metadata)


def test_sentencepiece_matches_transformers(sentencepiece_pair: tuple[Tokenizer, Any]) -> None:
    ours, theirs = sentencepiece_pair
    assert _mismatches(ours, theirs, [text for text in SPM_TEXTS if not text.startswith(" ")]) == []
    # llama.cpp always puts the prefix space in front; transformers' Metaspace(prepend_scheme="first")
    # skips it when the text already starts with a space. So "  two" is ▁▁▁two here and ▁▁two there,
    # and llama.cpp's tokens for a text are transformers' tokens for that text with a space in front.
    assert [text for text in SPM_TEXTS if text and ours.encode(text) != theirs.encode(" " + text)] == []
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_round_trips_with_byte_fallback(sentencepiece_pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = sentencepiece_pair
    assert [text for text in SPM_TEXTS if not _round_trips(ours, text)] == []
    ids = ours.encode("漢字🚀", add_special_tokens=False)  # not in the capped alphabet
    assert len(ids) >= 10 and all(3 <= i < 3 + 256 for i in ids[1:])
    assert ours.decode(ids) == "漢字🚀"


def test_sentencepiece_space_prefix_after_special_tokens(sentencepiece_pair: tuple[Tokenizer, Any]) -> None:
    """llama.cpp gives every text run after a special token the prefix space, as at the start. (transformers
    uses Metaspace(prepend_scheme="first"), which prefixes only the first run, so it is not compared.)"""
    ours, _ = sentencepiece_pair
    hello = ours.encode("hello", add_special_tokens=False)
    assert ours.token_text(hello[0]).startswith(" ")  # ▁hello or ▁ + hello
    assert ours.encode("</s>hello", add_special_tokens=False) == [2, *hello]
    assert ours.encode("hello</s>hello", add_special_tokens=False) == [*hello, 2, *hello]
    assert ours.encode("<s>hello") == [1, 1, *hello]


def test_sentencepiece_without_space_prefix(sentencepiece_vocab: dict[str, Any]) -> None:
    ours = tokenizer_from_gguf({**sentencepiece_vocab, "tokenizer.ggml.add_space_prefix": False})
    prefixed = tokenizer_from_gguf(sentencepiece_vocab)
    assert [text for text in SPM_TEXTS if text and ours.encode(" " + text) != prefixed.encode(text)] == []
    assert [text for text in SPM_TEXTS if not _round_trips(ours, text)] == []


# ----------------------------------------------------------------------------------------------------
# What is not supported


def test_unknown_pre_type_and_model_are_refused(byte_level_vocab: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"'no-such-pre'.*smollm"):
        tokenizer_from_gguf({**byte_level_vocab, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ValueError, match="'t5'"):
        tokenizer_from_gguf({**byte_level_vocab, "tokenizer.ggml.model": "t5"})
    for name in ("smollm", "llama-bpe", "qwen2", "gpt-2", "default", "llama3", "starcoder", "falcon"):
        assert name in PRE_TOKENIZERS


def test_missing_pre_type_means_default(byte_level_vocab: dict[str, Any]) -> None:
    missing = tokenizer_from_gguf(byte_level_vocab)
    default = tokenizer_from_gguf({**byte_level_vocab, "tokenizer.ggml.pre": "default"})
    assert all(missing.encode(text) == default.encode(text) for text in TEXTS)


# ----------------------------------------------------------------------------------------------------
# Merges built at the first encode (an engine core only decodes)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece-scores", "sentencepiece-merges"])
def test_lazy_merges_decode_alike_and_are_built_at_the_first_encode(
        kind: str, byte_level_vocab: dict[str, Any], sentencepiece_vocab: dict[str, Any]) -> None:
    metadata = dict(byte_level_vocab if kind == "byte-level" else sentencepiece_vocab)
    if kind == "sentencepiece-scores":
        del metadata["tokenizer.ggml.merges"]
    whole, lazy = tokenizer_from_gguf(metadata), tokenizer_from_gguf(metadata, lazy_merges=True)
    texts = TEXTS if kind == "byte-level" else SPM_TEXTS
    ids = [whole.encode(text) for text in texts]
    rng = random.Random(0)
    ids += [[rng.randrange(whole.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(200)]
    for sequence in ids:
        for skip in (True, False):
            assert lazy.decode(sequence, skip_special_tokens=skip) == whole.decode(sequence, skip_special_tokens=skip)
    assert (lazy.vocab_size, lazy.eos_token_ids, lazy.special_tokens, lazy.bos_token_id) == (
        whole.vocab_size, whole.eos_token_ids, whole.special_tokens, whole.bos_token_id)
    assert lazy._complete is not None  # decoding built no merges
    assert [lazy.encode(text) for text in texts] == ids[:len(texts)]
    assert lazy._complete is None and lazy.backend_json() == whole.backend_json()
    every = sorted({i for sequence in ids for i in sequence})
    assert [lazy.token_bytes(i) for i in every] == [whole.token_bytes(i) for i in every]
    assert [lazy.token_text(i) for i in every] == [whole.token_text(i) for i in every]
