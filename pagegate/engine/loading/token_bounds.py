"""How many input characters one token can stand for: the bound that lets a server refuse an over-long
text before tokenizing it (tokenizing megabytes takes seconds)."""

from __future__ import annotations

import functools
import json
from typing import Any

import tokenizers
from tokenizers import pre_tokenizers

COMPOSING_SHRINK = 4  # NFC/NFKC compose at most 4 code points into one (U+1F82 decomposes into 4)
_SAME_LENGTH_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})  # never shorten
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})  # split, drop nothing


def chars_per_token_bound(backend: tokenizers.Tokenizer) -> int | None:
    """The most input characters one token can stand for, or None when this tokenizer has no such bound.

    A BPE token covers at most as many normalized characters as its vocabulary string is long (byte-level
    vocabularies spell one byte per character, and a character is at least a byte). That bounds the
    input only when every character ends up in some token and normalization shrinks text by a known
    factor: so byte-level, byte-fallback or one-unknown-per-character BPE; no deleting normalizer (Strip,
    StripAccents, regex Replace) or pre-tokenizer (whitespace splitters); no added token that swallows the
    whitespace beside it (lstrip/rstrip). Anything else gets None, and only tokenization can tell.
    """
    normalizer, pre_tokenizer = _state(backend.normalizer), _state(backend.pre_tokenizer)
    shrink = _normalizer_shrink(normalizer)
    if shrink is None or not _keeps_text(pre_tokenizer) or not _covers_every_character(backend, pre_tokenizer):
        return None
    if any(token.lstrip or token.rstrip for token in backend.get_added_tokens_decoder().values()):
        return None
    longest = max(map(len, backend.get_vocab(with_added_tokens=True)), default=0)
    return longest * shrink or None


def _state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's tokenizer.json entry."""
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(state: dict[str, Any] | None) -> int | None:
    """How many input characters may become one normalized character (None: unbounded or unknown)."""
    if state is None:
        return 1
    kind = state.get("type")
    if kind == "Sequence":
        factors = [_normalizer_shrink(child) for child in state.get("normalizers", [])]
        known = [f for f in factors if f is not None]
        return functools.reduce(lambda a, b: a * b, known, 1) if len(known) == len(factors) else None
    if kind in ("NFC", "NFKC"):
        return COMPOSING_SHRINK
    if kind in _SAME_LENGTH_NORMALIZERS:
        return 1
    if kind == "Replace":
        pattern, content = state.get("pattern", {}).get("String"), state.get("content")
        return -(-len(pattern) // len(content)) if pattern and content else None
    return None


def _keeps_text(state: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer hands every character on (splitting is fine, removing is not)."""
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_keeps_text(child) for child in state.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return state.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _covers_every_character(backend: tokenizers.Tokenizer, pre_tokenizer: dict[str, Any] | None) -> bool:
    """No character is dropped, and none joins a fused run of unknowns: BPE that is byte-level (with the
    whole byte alphabet), or falls back to byte tokens, or gives each unknown character its own token."""
    model = backend.model
    if not isinstance(model, tokenizers.models.BPE):
        return False
    vocab = backend.get_vocab(with_added_tokens=False)
    if model.byte_fallback and all(f"<0x{byte:02X}>" in vocab for byte in range(256)):
        return True
    if model.unk_token is not None and not model.fuse_unk:
        return True
    byte_level = "ByteLevel" in _kinds(pre_tokenizer)
    return byte_level and all(char in vocab for char in pre_tokenizers.ByteLevel.alphabet())


def _kinds(state: dict[str, Any] | None) -> set[str]:
    """The component types in a (Sequence of) pre-tokenizer state(s)."""
    if state is None:
        return set()
    children = state.get("pretokenizers", [])
    return {state.get("type", "")}.union(*(_kinds(child) for child in children))
