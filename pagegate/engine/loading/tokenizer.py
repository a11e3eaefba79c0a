"""Tokenizer (tokenizer.json + tokenizer_config.json), chat templates (rendered by chat_template.py), streaming
detokenization."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pagegate.engine.loading.token_bounds import chars_per_token_bound
from pagegate.engine.models.config import token_id_list

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _gpt2_byte_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes for each byte: printable Latin-1 stays, the rest moves past 255."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_OF_CHAR = _gpt2_byte_alphabet()
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                       "mask_token")


class Tokenizer:
    """Encode, decode and render chat prompts the way Hugging Face does for the same folder.

    bos/eos are added by tokenizer.json's post-processor alone; like transformers 5, the
    add_bos_token / add_eos_token flags of tokenizer_config.json are ignored when tokenizer.json exists.
    """

    def __init__(self, tokenizer: HFTokenizer, tokenizer_config: dict[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos_token_ids: Sequence[int] = (),
                 complete: Callable[[], HFTokenizer] | None = None) -> None:
        """`complete`: where `tokenizer` decodes but cannot encode yet (a GGUF's BPE without its merges:
        gguf_tokenizer's `lazy_merges`), what builds the whole one; called at the first encode."""
        self._tokenizer = tokenizer
        self._complete = complete
        config = tokenizer_config or {}
        self.special_tokens = {key: _token_content(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        eos = self._id_of(self.special_tokens["eos_token"])
        self.eos_token_ids: list[int] = list(dict.fromkeys(([eos] if eos is not None else []) +
                                                           list(extra_eos_token_ids)))
        self.chat_template = chat_template or _pick_template(config.get("chat_template"))
        self._token_texts: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer | None:
        """The folder's tokenizer, or None when it has no tokenizer.json."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            return None
        config = _read_json(folder / "tokenizer_config.json")
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        extra_eos = (token_id_list(_read_json(folder / "generation_config.json").get("eos_token_id")) +
                     token_id_list(_read_json(folder / "config.json").get("eos_token_id")))
        return cls(HFTokenizer.from_file(str(folder / "tokenizer.json")), config, template, extra_eos)

    def to_wire(self) -> dict[str, Any]:
        """Everything `from_wire` needs to rebuild this tokenizer in another process (the gateway's)."""
        return {"backend": self.backend_json(), "special_tokens": self.special_tokens,
                "chat_template": self.chat_template, "eos_token_ids": self.eos_token_ids}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Tokenizer:
        return cls(HFTokenizer.from_str(wire["backend"]), dict(wire["special_tokens"]), wire["chat_template"],
                   wire["eos_token_ids"])

    @property
    def _encoder(self) -> HFTokenizer:
        """The whole tokenizer, built now where it was left incomplete (`complete`)."""
        if self._complete is not None:
            self._tokenizer, self._complete = self._complete(), None
        return self._tokenizer

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most input characters one token can stand for (None: no such bound); see token_bounds."""
        return chars_per_token_bound(self._encoder)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer serialized (tokenizer.json), for libraries that build their own."""
        return self._encoder.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; add_special_tokens adds what the post-processor adds (usually bos)."""
        return self._encoder.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's surface text (with its leading space), for logprobs."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._surface_text(token_id)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, which may be part of a UTF-8 character (its text then shows U+FFFD):
        byte-level BPE pieces mapped back through GPT-2's byte alphabet, `<0xNN>` byte-fallback pieces as
        their byte, anything else (special tokens, whole pieces) as its text in UTF-8."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = self._own_bytes(token_id)
        return raw

    def _own_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None or token_id in self._added_token_ids:
            return self.token_text(token_id).encode()
        if self._byte_level and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        return self.token_text(token_id).encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        decoder = self._tokenizer.decoder
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._tokenizer.get_added_tokens_decoder())

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **extra: Any) -> str:
        """Render messages with `chat_template` or the model's own; tokenize the result with `encode_chat`."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        from pagegate.engine.loading.chat_template import compile_template

        variables = {key: value or "" for key, value in self.special_tokens.items()}
        variables.update(extra)
        return compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (a caller describes tools itself otherwise)."""
        return "tools" in self.chat_template_variables

    @property
    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (enable_thinking, reasoning_effort, ...)."""
        if not self.chat_template:
            return frozenset()
        from pagegate.engine.loading.chat_template import template_variables

        return template_variables(self.chat_template)

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a rendered chat: its own special tokens, plus the BOS the model expects only if the
        template did not write it (templates that do must not get a second one)."""
        token_ids = self.encode(text, add_special_tokens=False)
        prefix = [t for t in self.encode("", add_special_tokens=True) if t not in self.eos_token_ids]
        if prefix and token_ids[:len(prefix)] != prefix:
            token_ids = prefix + token_ids
        return token_ids

    @functools.cached_property
    def _anchor_ids(self) -> list[int]:
        return self.encode("a", add_special_tokens=False)[-1:]

    def _surface_text(self, token_id: int) -> str:
        # Decoded after an anchor token, a leading space survives decoders that strip it at the start.
        anchor = self.decode(self._anchor_ids, skip_special_tokens=False)
        both = self.decode([*self._anchor_ids, token_id], skip_special_tokens=False)
        if anchor and both.startswith(anchor):
            return both[len(anchor):]
        return self.decode([token_id], skip_special_tokens=False)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)



def _token_content(value: str | dict[str, Any] | None) -> str | None:
    """A special token as tokenizer_config writes it: a string or a serialised AddedToken."""
    return value.get("content") if isinstance(value, dict) else value


def _pick_template(value: str | list[dict[str, str]] | None) -> str | None:
    if isinstance(value, list):  # named templates: use "default"
        named = {item["name"]: item["template"] for item in value}
        return named.get("default")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class IncrementalDetokenizer:
    """Turns a sequence's new token ids into new text, never splitting a UTF-8 character.

    Decodes only a window: text of ids[prefix_offset:] minus text of ids[prefix_offset:read_offset]
    (vLLM's scheme), so each step costs a few tokens whatever the sequence length.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # context so the first output token's leading space is right
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""

    def step(self, new_ids: Sequence[int]) -> str:
        """Append token ids and return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new, or a multi-byte character still incomplete
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever is held back (an incomplete character decodes to U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopChecker:
    """Finds stop strings across token boundaries; holds back a tail that may start one."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop  # the output ends after the stop string rather than before it
        self.held = ""
        self.stopped_by: str | None = None

    def step(self, delta: str) -> tuple[str, str | None]:
        """Feed new text; return (text safe to emit, the stop string that matched or None).

        After a match the output ends right before the stop string (after it with include_stop) and nothing
        more is emitted.
        """
        if self.stopped_by is not None:
            return "", self.stopped_by
        text = self.held + delta
        match = self._earliest_match(text)
        if match is not None:
            position, self.stopped_by = match
            self.held = ""
            return text[:position + (len(self.stopped_by) if self.include_stop else 0)], self.stopped_by
        keep = self._partial_tail_length(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """The held tail, when the sequence ends for another reason."""
        tail, self.held = self.held, ""
        return tail if self.stopped_by is None else ""

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first (the longest on a tie): the same whatever the chunking."""
        found = [(text.find(s), s) for s in self.stop]
        found = [(pos, s) for pos, s in found if pos >= 0]
        return min(found, key=lambda item: (item[0] + len(item[1]), item[0])) if found else None

    def _partial_tail_length(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for length in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[len(text) - length:]):
                    longest = length
                    break
        return longest
