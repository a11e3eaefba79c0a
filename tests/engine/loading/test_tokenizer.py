"""Tokenizer parity with transformers, chat templates, streaming detokenization and stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.engine.loading.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

from ..conftest import hf

DEFAULT_MODEL = Path(__file__).resolve().parents[3] / "pagegate" / "engine" / "default_model"
TEXTS = ["Hello world!", " leading space", "  two spaces\n\nnewlines", "emoji 😀🎉 and CJK 你好，世界", "",
         "café naïve — “quotes”", "<|user|>hi<|end|></s><s>", "def f(x):\n    return x * 2", "unseen 🚀 漢字"]
MULTIBYTE = "Paged 😀🎉👍 attention 你好，世界。日本語 café 한국어 — “done” 🚀 漢字 Ω"  # last 3: unseen
FOLDERS = ["bytelevel_tokenizer_dir", "metaspace_tokenizer_dir", "default_model_dir"]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return DEFAULT_MODEL


@pytest.fixture(params=FOLDERS)
def folder(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture
def pair(folder: Path) -> tuple[Tokenizer, object]:
    """Our tokenizer and transformers' AutoTokenizer for the same folder."""
    tokenizer = Tokenizer.from_folder(folder)
    assert tokenizer is not None
    return tokenizer, _auto_tokenizer(folder)


_AUTO: dict[Path, object] = {}


def _auto_tokenizer(folder: Path) -> object:
    if folder not in _AUTO:
        _AUTO[folder] = hf().AutoTokenizer.from_pretrained(folder)
    return _AUTO[folder]


def test_encode_matches_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        plain = ours.encode(text, add_special_tokens=False)
        assert plain == theirs.encode(text, add_special_tokens=False), text


def test_decode_matches_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, theirs = pair
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)


def test_special_ids_and_vocab_match_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, theirs = pair
    assert ours.bos_token_id == theirs.bos_token_id
    assert theirs.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(theirs)


def test_bos_from_the_post_processor(bytelevel_tokenizer_dir: Path, metaspace_tokenizer_dir: Path) -> None:
    bytelevel = Tokenizer.from_folder(bytelevel_tokenizer_dir)
    metaspace = Tokenizer.from_folder(metaspace_tokenizer_dir)
    assert bytelevel.encode("hi")[0] == bytelevel.bos_token_id == 0
    assert metaspace.encode("hi")[0] == metaspace.bos_token_id == 1
    assert metaspace.encode("hi", add_special_tokens=False)[0] != 1


def test_chat_template_matches_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, theirs = pair
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    for add_generation_prompt in (True, False):
        expected = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_errors(bytelevel_tokenizer_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_folder(bytelevel_tokenizer_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert rendered == "<|begin|><|user|>x<|end|><|assistant|>"
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer.json").write_text((bytelevel_tokenizer_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    bare = Tokenizer.from_folder(tmp_path)
    assert bare.eos_token_ids == [1] and bare.bos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_is_sandboxed(bytelevel_tokenizer_dir: Path) -> None:
    tokenizer = Tokenizer.from_folder(bytelevel_tokenizer_dir)
    tokenizer.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.apply_chat_template([])


def test_from_folder_without_tokenizer_is_none(tmp_path: Path) -> None:
    assert Tokenizer.from_folder(tmp_path) is None


def test_eos_ids_include_generation_config(bytelevel_tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((bytelevel_tokenizer_dir / name).read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == [1, 3]


def test_token_text_keeps_leading_spaces(bytelevel_tokenizer_dir: Path,
                                         metaspace_tokenizer_dir: Path) -> None:
    text = "The quick brown fox jumps"
    for folder, expected in ((bytelevel_tokenizer_dir, text), (metaspace_tokenizer_dir, " " + text)):
        tokenizer = Tokenizer.from_folder(folder)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > 3
        assert "".join(tokenizer.token_text(i) for i in ids) == expected
        assert tokenizer.token_text(tokenizer.eos_token_ids[0]) in ("<|end|>", "</s>")


def _stream(tokenizer: Tokenizer, ids: list[int], prompt: list[int] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.step([i]) for i in ids]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("name", FOLDERS)
def test_incremental_detokenization_never_splits_characters(name: str,
                                                            request: pytest.FixtureRequest) -> None:
    tokenizer = Tokenizer.from_folder(request.getfixturevalue(name))
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text must split characters"
    deltas = _stream(tokenizer, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "" in deltas[:-1]  # something was held back


@pytest.mark.parametrize("name", FOLDERS)
def test_incremental_detokenization_continues_the_prompt(name: str, request: pytest.FixtureRequest) -> None:
    tokenizer = Tokenizer.from_folder(request.getfixturevalue(name))
    prompt = tokenizer.encode("Hello world")
    out = tokenizer.encode(" quick fox 😀 jumps", add_special_tokens=False)
    text = "".join(_stream(tokenizer, out, prompt))
    assert text == tokenizer.decode(prompt + out)[len(tokenizer.decode(prompt)):]
    assert text.startswith(" quick")


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab 😀你好é\n!", max_size=30))
def test_incremental_detokenization_property(bytelevel_tokenizer_dir: Path, text: str) -> None:
    tokenizer = _cached_tokenizer(bytelevel_tokenizer_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


_TOKENIZERS: dict[Path, Tokenizer] = {}


def _cached_tokenizer(folder: Path) -> Tokenizer:
    if folder not in _TOKENIZERS:
        _TOKENIZERS[folder] = Tokenizer.from_folder(folder)
    return _TOKENIZERS[folder]


def test_stop_string_across_tokens_is_trimmed(bytelevel_tokenizer_dir: Path) -> None:
    tokenizer = Tokenizer.from_folder(bytelevel_tokenizer_dir)
    ids = tokenizer.encode("The end is near; STOP here and never again", add_special_tokens=False)
    detok, checker = IncrementalDetokenizer(tokenizer), StopChecker(["STOP here"])
    emitted, stopped_at = [], None
    for step, token in enumerate(ids):
        text, stop = checker.step(detok.step([token]))
        emitted.append(text)
        if stop is not None:
            stopped_at = step
            break
    assert stopped_at is not None and stopped_at < len(ids) - 1
    assert "".join(emitted) == "The end is near; "
    assert checker.step(" more")[0] == "" and checker.flush() == ""


def test_stop_checker_holds_back_a_forming_stop_string() -> None:
    checker = StopChecker(["</answer>"])
    assert checker.step("result: 42 </ans") == ("result: 42 ", None)
    assert checker.step("wer>") == ("", "</answer>")
    checker = StopChecker(["</answer>"])
    assert checker.step("a </an") == ("a ", None)
    assert checker.step("d so on") == ("</and so on", None)
    assert checker.flush() == ""
    checker = StopChecker(["xyz"])
    assert checker.step("abc x") == ("abc ", None)
    assert checker.flush() == "x"


def _first_stop(text: str, stops: list[str]) -> str:
    """Reference: the text before the stop string that completes first (the longest on a tie)."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if s and text[:end].endswith(s)]
        if matches:
            return text[: end - max(len(s) for s in matches)]
    return text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc", max_size=25),
       st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(1, 5), min_size=1, max_size=25))
def test_stop_checker_matches_reference_for_any_chunking(text: str, stops: list[str],
                                                         sizes: list[int]) -> None:
    checker, out, pos, i = StopChecker(stops), [], 0, 0
    while pos < len(text):
        size = sizes[i % len(sizes)]
        emitted, stop = checker.step(text[pos:pos + size])
        out.append(emitted)
        pos, i = pos + size, i + 1
        if stop is not None:
            break
    out.append(checker.flush())
    assert "".join(out) == _first_stop(text, stops)
