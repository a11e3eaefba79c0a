"""The bound on characters per token that lets the gateway refuse an over-long text before tokenizing it."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE, WordPiece

from pagegate.engine.loading.loader import DEFAULT_MODEL
from pagegate.engine.loading.token_bounds import chars_per_token_bound
from pagegate.engine.loading.tokenizer import Tokenizer

SAMPLES = ["a" * 5000, " " * 5000, "\n" * 3000, "hello world " * 300, "🙂" * 500, "e\u0301" * 500,
           "Ἂ" * 500, "<|end|>" * 200, "x = [1, 2, 3]\n\tprint(x)\n" * 100]


def test_embedded_tokenizer_bound_holds() -> None:
    tokenizer = Tokenizer.from_folder(DEFAULT_MODEL)
    bound = tokenizer.max_chars_per_token
    assert bound is not None and bound >= 4
    for text in SAMPLES:
        assert len(text) <= bound * len(tokenizer.encode(text, add_special_tokens=False)), text[:20]


def byte_fallback_bpe(normalizer: normalizers.Normalizer | None = None) -> HFTokenizer:
    vocab = {f"<0x{byte:02X}>": byte for byte in range(256)} | {"▁": 256, "a": 257, "▁a": 258, "aa": 259}
    backend = HFTokenizer(BPE(vocab, [("▁", "a"), ("a", "a")], byte_fallback=True))
    if normalizer is not None:
        backend.normalizer = normalizer
    return backend


def test_bound_of_composing_normalizers() -> None:
    backend = byte_fallback_bpe(normalizers.Sequence([normalizers.NFC(), normalizers.Replace(" ", "▁")]))
    bound = chars_per_token_bound(backend)
    assert bound == 4 * len("<0x00>")
    for text in SAMPLES:
        assert len(text) <= bound * len(backend.encode(text, add_special_tokens=False).ids), text[:20]


def swallows_whitespace() -> HFTokenizer:
    backend = byte_fallback_bpe()
    backend.add_special_tokens([AddedToken("<x>", rstrip=True)])
    return backend


def whitespace_split() -> HFTokenizer:
    backend = byte_fallback_bpe()
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return backend


@pytest.mark.parametrize("make", [
    lambda: byte_fallback_bpe(normalizers.Strip()),  # deletes leading and trailing whitespace
    lambda: byte_fallback_bpe(normalizers.StripAccents()),  # deletes any number of combining marks
    whitespace_split,  # runs of whitespace become nothing
    swallows_whitespace,  # one token takes all the whitespace after it
    lambda: HFTokenizer(WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),  # a long word is one [UNK]
    lambda: HFTokenizer(BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)),  # unknowns fuse
])
def test_no_bound_where_one_token_can_cover_any_length(make) -> None:
    assert chars_per_token_bound(make()) is None
