"""The README and docs/*.md hold together: every relative link and image points at a file that exists (and an
anchor into a Markdown page at one of its headings, by GitHub's slugs), every flag of a quoted `pagegate serve`
command is an option of the serve CLI's parser, and the README stays a front door of at most 250 lines.

No network and no server: the parser is built, never run."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from pagegate.gateway.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LONG_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def split_code(text: str) -> tuple[str, list[list[str]]]:
    """The page's prose (code blanked, lines kept in place) and its code blocks, fenced or indented by 4 spaces."""
    prose: list[str] = []
    blocks: list[list[str]] = []
    fence: str | None = None
    indented = previous_blank = False
    for line in text.split("\n"):
        marker = _FENCE.match(line)
        code = True
        if fence is None and marker:  # a fence opens
            fence = marker.group(1)
            blocks.append([])
        elif fence is not None:  # inside a fence, or its end
            if marker and marker.group(1) == fence:
                fence = None
            else:
                blocks[-1].append(line)
        elif line.startswith("    ") and line.strip() and (previous_blank or indented):  # an indented code line
            if not indented:
                blocks.append([])
            blocks[-1].append(line[4:])
            indented = True
        else:
            code = False
            indented = indented and not line.strip()  # a blank line may sit inside an indented block
        prose.append("" if code else line)
        previous_blank = not line.strip()
    return "\n".join(prose), blocks


def without_inline_code(prose: str) -> str:
    return _INLINE_CODE.sub(" ", prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading's slug in a Markdown page (repeats numbered -1, -2, ... as GitHub does)."""
    prose, _ = split_code(page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose.split("\n"):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def link_targets(page: Path) -> list[str]:
    """The targets of the page's inline links, images and link references, outside code."""
    prose, _ = split_code(page.read_text(encoding="utf-8"))
    prose = without_inline_code(prose)
    return [m.group(1) for m in _LINK.finditer(prose)] + [m.group(1) for m in _REFERENCE.finditer(prose)]


def broken_link(page: Path, target: str) -> str | None:
    """Why a relative link does not resolve; None when it does (or is external)."""
    if _EXTERNAL.match(target):
        return None
    path_part, _, anchor = target.partition("#")
    path = (page.parent / path_part).resolve() if path_part else page
    if not path.exists():
        return f"{_rel(page)}: {target} -> no such file"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"{_rel(page)}: {target} -> no heading #{anchor} in {_rel(path)}"
    return None


def shell_lines(lines: list[str]) -> Iterator[list[str]]:
    """A code block's commands as shell words: backslash continuations and quotes across lines joined,
    comments dropped. A line shlex cannot read is split on whitespace."""
    buffer = ""
    for line in lines:
        buffer = f"{buffer}\n{line}" if buffer else line
        if buffer.endswith("\\"):
            buffer = buffer[:-1] + " "
            continue
        try:
            yield shlex.split(buffer, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        buffer = ""
    if buffer:
        yield buffer.split()


def inline_commands(prose: str) -> Iterator[list[str]]:
    for match in _INLINE_CODE.finditer(prose):
        code = " ".join(match.group(2).split())
        try:
            yield shlex.split(code, comments=True)
        except ValueError:
            yield code.split()


def serve_flags(words: list[str]) -> Iterator[str]:
    """The flags after each `pagegate serve` (or `python -m pagegate serve`) in one command."""
    for i in range(len(words) - 1):
        if words[i].endswith("pagegate") and words[i + 1] == "serve":
            for word in words[i + 2:]:
                if word in ("|", "&&", "||", ";"):
                    break
                if re.match(r"^--?[A-Za-z]", word):
                    yield word.split("=", 1)[0]


def quoted_serve_flags(page: Path) -> Iterator[str]:
    prose, blocks = split_code(page.read_text(encoding="utf-8"))
    for block in blocks:
        for words in shell_lines(block):
            yield from serve_flags(words)
    for words in inline_commands(prose):
        yield from serve_flags(words)


def table_flags(page: Path) -> Iterator[str]:
    """The long flags in the first column of the tables whose first header cell is `flag` or `pagegate`
    (the tables of serve flags; their other columns name llama.cpp's and vLLM's)."""
    prose, _ = split_code(page.read_text(encoding="utf-8"))
    header: str | None = None
    for line in prose.split("\n"):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        first = re.split(r"(?<!\\)\|", line.strip())[1].strip()
        if header is None:
            header = first.lower()
        elif header in ("flag", "pagegate") and not set(first) <= set("-: "):
            yield from _LONG_FLAG.findall(first)


@cache
def serve_options() -> frozenset[str]:
    return frozenset(option for action in build_parser()._actions for option in action.option_strings)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_and_images_resolve(page: Path) -> None:
    broken = [why for target in link_targets(page) if (why := broken_link(page, target))]
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_quoted_serve_commands_use_real_flags(page: Path) -> None:
    unknown = sorted({flag for flag in quoted_serve_flags(page) if flag not in serve_options()})
    assert unknown == [], f"{_rel(page)}: flags `pagegate serve` does not have"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_serve_flag_tables_use_real_flags(page: Path) -> None:
    unknown = sorted({flag for flag in table_flags(page) if flag not in serve_options()})
    assert unknown == [], f"{_rel(page)}: flags `pagegate serve` does not have"


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES
    text = "\n".join(lines)
    assert "test command" in text and "make test" in text  # .ci/run runs the README's test command


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """A broken link, a missing anchor and unknown flags (in code blocks, indented code and a flag table) are
    found; code is not read as links, nor comments as flags."""
    page = tmp_path / "page.md"
    page.write_text("# A `b` (c)\n\n[ok](#a-b-c) [gone](missing.md) [bad](#nope) `[x](not-a-link)`\n\n"
                    "```\npagegate serve --model M --no-such-flag  # --in-a-comment\n```\n\n"
                    "    python -m pagegate serve -tp 2 --kv-events-config '{\"a\":\n        1}' --bogus\n")
    assert sorted(filter(None, (broken_link(page, t) for t in link_targets(page)))) == [
        f"{_rel(page)}: #nope -> no heading #nope in {_rel(page)}",
        f"{_rel(page)}: missing.md -> no such file"]
    assert sorted(set(quoted_serve_flags(page)) - serve_options()) == ["--bogus", "--no-such-flag"]
    table = tmp_path / "table.md"
    table.write_text("| flag | default |\n|---|---|\n| `--model PATH` | x |\n| `--gone N` | 1 |\n")
    assert list(table_flags(table)) == ["--model", "--gone"]

