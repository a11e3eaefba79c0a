"""The tokenizer a GGUF file describes, built with `tokenizers` so it tokenizes the way llama.cpp does.

A GGUF carries no tokenizer.json: it stores the vocabulary, merges, token types and special token ids as
`tokenizer.ggml.*` metadata. Two vocabulary kinds are supported:

- `gpt2`: byte-level BPE. Text is split by the regexes llama.cpp uses for the file's `tokenizer.ggml.pre`
  (each regex applied in turn to the pieces the previous one left, keeping matches and gaps alike), then
  mapped to the byte alphabet and merged by rank.
- `llama`: SentencePiece BPE over `▁`-spelled tokens with `<0xNN>` byte fallback. llama.cpp merges by
  token score, so when the file has no merges they are derived from the scores.

Control tokens become special added tokens and user-defined ones plain added tokens, so both stay whole.
Generation ends, as in llama.cpp, on the EOS / EOT / EOM / FIM-separator ids the file names and on every
token whose text is in llama.cpp's end-of-generation list (`<end_of_turn>`, `<|im_end|>`, `<|endoftext|>`...):
converted Gemma 3 and Qwen3 files name only one of the two tokens their models stop on.

Where a family's tokenizer.json normalizes its text (NFC for Qwen2 / Qwen3 / Qwen3.5) the file does not say
so and llama.cpp skips it; here the family's pre-tokenizer type brings it back, so the ids are transformers'.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from pagegate.engine.loading.gguf_strings import merge_pairs
from pagegate.engine.loading.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6
_ADDED = (_UNKNOWN, _CONTROL, _USER_DEFINED)  # added tokens, kept whole: special ones, and user-defined ones

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + (r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                           r"|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + (r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                          r"|\s+(?!\S)|\s+")
_QWEN35 = _CONTRACTIONS + (r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DIGIT = r"\p{N}"


@dataclass(frozen=True)
class _PreTokenizer:
    """One llama.cpp pre-tokenizer type: its split regexes and the flags it implies."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is not merged from characters
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token
    nfc: bool = False  # the family's tokenizer.json normalizes to NFC (llama.cpp does not)


_DEFAULT = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))


def _group(names: Iterable[str], pre: _PreTokenizer) -> dict[str, _PreTokenizer]:
    return dict.fromkeys(names, pre)


# tokenizer.ggml.pre names, grouped as llama.cpp's llama-vocab.cpp groups them.
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _DEFAULT,
    **_group(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
              "jina-v5-nano"), _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_group(("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3,))),
    **_group(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
             _PreTokenizer((_DIGIT, _GPT2))),
    **_group(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
              "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"),
             _PreTokenizer((_GPT2,))),
    "qwen2": _PreTokenizer((_QWEN2,), nfc=True),
    **_group(("deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
             _PreTokenizer((_QWEN2,))),
    "qwen35": _PreTokenizer((_QWEN35,), nfc=True),
    "falcon": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    **_group(("poro-chat", "bloom", "gpt3-finnish"), _PreTokenizer((_BLOOM,))),
    "viking": _PreTokenizer((_BLOOM, _DIGIT)),
}


def tokenizer_from_gguf(metadata: Mapping[str, Any], lazy_merges: bool = False) -> Tokenizer:
    """The tokenizer described by a GGUF's metadata (GGUFContents' own, or `{name: field.contents()}` of GGUFReader).

    Raises ValueError for a vocabulary kind other than `gpt2` / `llama`, or an unknown `tokenizer.ggml.pre`.
    A missing `tokenizer.ggml.pre` means llama.cpp's `default` pre-tokenizer, as in llama.cpp. `lazy_merges`: the
    BPE merges are built at the first encode (Tokenizer's `complete`), so an engine core, which only decodes, never
    builds them (~half of building SmolLM2's tokenizer).
    """
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer.ggml.model {model!r}; supported: gpt2, llama")
    # llama.cpp renames empty tokens so every id has a distinct text
    tokens = list(metadata["tokenizer.ggml.tokens"])
    if "" in tokens:
        tokens = [token or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]
    types = _numbers(metadata, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    named = {name: metadata.get(f"tokenizer.ggml.{name}_token_id")
             for name in ("bos", "eos", "unknown", "padding", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")}
    ids: dict[str, int] = {name: int(i) for name, i in named.items() if i is not None}
    if model == "llama":
        ids = {"bos": 1, "eos": 2, "unknown": 0} | ids
    ids = {name: i for name, i in ids.items() if 0 <= i < len(tokens)}
    build = functools.partial(_backend, metadata, tokens, types, ids)
    config = {key: tokens[ids[name]] for key, name in (("bos_token", "bos"), ("eos_token", "eos"),
                                                      ("unk_token", "unknown"), ("pad_token", "padding"))
              if name in ids}
    return Tokenizer(build(merges=not lazy_merges), config, metadata.get("tokenizer.chat_template"),
                     _end_of_generation(tokens, ids), complete=build if lazy_merges else None)


def _backend(metadata: Mapping[str, Any], tokens: list[str], types: list[int], ids: Mapping[str, int],
             merges: bool = True) -> HFTokenizer:
    """The `tokenizers` tokenizer of the file's vocabulary; `merges`: False leaves its BPE without the merges,
    which decoding needs none of."""
    # the merges' ~50,000 pairs, garbage once the BPE holds them, set off collections (~4 ms of building SmolLM2's
    # tokenizer, which a server does before it is healthy)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _built_backend(metadata, tokens, types, ids, merges)
    finally:
        if enabled:
            gc.enable()


def _built_backend(metadata: Mapping[str, Any], tokens: list[str], types: list[int], ids: Mapping[str, int],
                   merges: bool) -> HFTokenizer:
    if metadata.get("tokenizer.ggml.model") == "gpt2":
        backend, add_bos = _byte_level(metadata, tokens, merges)
    else:
        backend, add_bos = _sentencepiece(metadata, tokens, types, ids.get("unknown", -1), merges), True
    added = [(token, kind) for token, kind in zip(tokens, types, strict=True) if kind in _ADDED]
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, kind in added if kind != _USER_DEFINED])
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, kind in added if kind == _USER_DEFINED])
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(tokens, ids.get("bos") if add_bos else None,
                                             ids.get("eos") if add_eos else None)
    return backend


# Token texts llama.cpp (llama-vocab.cpp) ends generation on, whatever the file's metadata names.
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["))


def _end_of_generation(tokens: list[str], ids: Mapping[str, int]) -> list[int]:
    """The ids besides EOS that end generation in llama.cpp: EOT, EOM and the FIM pad / repo / separator
    tokens the file names, and the tokens of `_EOG_TEXTS`, less llama.cpp's two exceptions: `<|end|>` next to
    both `<|return|>` and `<|call|>` (gpt-oss) or `<|calls|>` and `<|flush|>`, and a plain `</s>` next to
    `<|tool_response>` or `<|plamo:eos|>`."""
    found = [ids[name] for name in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep") if name in ids]
    found += [index for index, token in enumerate(tokens) if token in _EOG_TEXTS]
    texts = {tokens[index] for index in [*found, *([ids["eos"]] if "eos" in ids else [])]}
    dropped: set[str] = set()
    if {"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts:
        dropped.add("<|end|>")
    if texts & {"<|tool_response>", "<|plamo:eos|>"}:
        dropped.add("</s>")
    return list(dict.fromkeys(index for index in found if tokens[index] not in dropped))


def _byte_level(metadata: Mapping[str, Any], tokens: list[str], merges: bool = True) -> tuple[HFTokenizer, bool]:
    """Byte-level BPE with the split regexes of the file's pre-tokenizer type; also its add-BOS default."""
    name = metadata.get("tokenizer.ggml.pre")
    if name is None:
        logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
        name = "default"
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise ValueError(f"unsupported GGUF tokenizer.ggml.pre {name!r}; supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    if "tokenizer.ggml.merges" not in metadata:
        raise ValueError("GGUF byte-level (gpt2) vocabulary has no tokenizer.ggml.merges")
    pairs = merge_pairs(metadata["tokenizer.ggml.merges"]) if merges else []
    backend = HFTokenizer(BPE(_vocab(tokens), pairs, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, pre.add_bos


def _sentencepiece(metadata: Mapping[str, Any], tokens: list[str], types: list[int], unk_id: int,
                   merges: bool = True) -> HFTokenizer:
    """SentencePiece BPE: spaces spelled `▁`, unknown characters as `<0xNN>` bytes."""
    pairs: list[tuple[str, str]] = []
    if merges and "tokenizer.ggml.merges" in metadata:
        pairs = merge_pairs(metadata["tokenizer.ggml.merges"])
    elif merges:
        scores = _numbers(metadata, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        pairs = _merges_from_scores(tokens, types, scores)
    unk = tokens[unk_id] if 0 <= unk_id < len(tokens) else None
    backend = HFTokenizer(BPE(_vocab(tokens), pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer (not Metaspace) so that, like llama.cpp, every text run between special tokens gets
    # the prefix space, not just the first one.
    escape = [normalizers.Replace(" ", "▁")]
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), *escape] if space_prefix else escape)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    return backend


def vocabulary(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """What tokenizer_from_gguf reads of a GGUF's metadata (its `tokenizer.*` keys), in plain lists and scalars: what
    builds the same tokenizer in another process (frames.EarlyTokenizer)."""
    return {key: _plain(value) for key, value in metadata.items() if key.startswith("tokenizer.")}


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value  # gguf_reader keeps arrays as numpy views


def _numbers(metadata: Mapping[str, Any], key: str) -> list[Any]:
    """A numeric array as a list ([] when missing)."""
    value = metadata.get(key)
    return [] if value is None else list(_plain(value))


def _vocab(tokens: list[str]) -> dict[str, int]:
    return dict(zip(tokens, range(len(tokens)), strict=True))


def _merges_from_scores(tokens: list[str], types: list[int],
                        scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges that reproduce llama.cpp's SentencePiece tokenizer, which joins the adjacent pair whose
    concatenation is the best-scoring token: every split of a token into two tokens, best score first."""
    mergeable = {token: index for index, (token, kind) in enumerate(zip(tokens, types, strict=True))
                 if kind not in (_UNKNOWN, _CONTROL, _BYTE)}
    ranked = []
    for token, index in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _post_processor(tokens: list[str], bos: int | None, eos: int | None) -> processors.TemplateProcessing:
    """Adds BOS / EOS around each sequence (placeholder names keep odd token texts out of the template)."""
    prefix, suffix, special = [], [], []
    if bos is not None:
        prefix = ["bos"]
        special.append({"id": "bos", "ids": [bos], "tokens": [tokens[bos]]})
    if eos is not None:
        suffix = ["eos"]
        special.append({"id": "eos", "ids": [eos], "tokens": [tokens[eos]]})
    return processors.TemplateProcessing(single=[*prefix, "$A", *suffix],
                                         pair=[*prefix, "$A", *suffix, *prefix, "$B:1", *suffix],
                                         special_tokens=special)
