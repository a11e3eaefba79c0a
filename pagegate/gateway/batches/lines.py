"""A batch's input file, line by line: each non-blank line is a request to run or a bad line for the error file.

NOTE: reading is deterministic (the same file gives the same lines, the same first holder of a repeated
custom_id), so the file is read again wherever it is needed (checking it, running it, assembling the output)
instead of being held in memory or copied into the database, and a resumed batch sees exactly what it saw.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_LINES = 50_000  # requests in one batch (OpenAI's bound)
MAX_CUSTOM_ID = 512  # characters


@dataclass(frozen=True, slots=True)
class BatchLine:
    """A request to run: its body as JSON, sent to the batch's endpoint."""

    index: int  # the line's number in the file, from 0 (blank lines count)
    custom_id: str
    body: bytes


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line refused before it was run (`error` in the error file, no response)."""

    index: int
    custom_id: str | None
    code: str
    message: str


Line = BatchLine | BadLine


@dataclass(frozen=True)
class FileCheck:
    total: int  # requests (non-blank lines)
    bad: int  # of them, bad lines


class InvalidInputFile(Exception):
    """The input as a whole is not a batch (the batch fails with this in its `errors`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def read_lines(path: Path, endpoint: str) -> Generator[Line, None, None]:
    """The file's requests in order, each checked as a line of a batch for `endpoint`."""
    seen: set[str] = set()
    with path.open("rb") as source:
        for index, raw in enumerate(source):
            if raw.strip():
                yield _line(index, raw, endpoint, seen)


def check_file(path: Path, endpoint: str) -> FileCheck:
    """Count the requests; InvalidInputFile for a file with none, none that is a JSON object, or too many."""
    total = bad = objects = 0
    for line in read_lines(path, endpoint):
        total += 1
        if total > MAX_LINES:
            raise InvalidInputFile("too_many_requests", f"The input file has more than {MAX_LINES} requests.")
        if isinstance(line, BadLine):
            bad += 1
            objects += line.code != "invalid_json_line"
        else:
            objects += 1
    if total == 0:
        raise InvalidInputFile("empty_file", "The input file is empty: it holds no request.")
    if objects == 0:
        raise InvalidInputFile("invalid_file_format",
                               "The input file is not JSONL: none of its lines is a JSON object.")
    return FileCheck(total, bad)


def _line(index: int, raw: bytes, endpoint: str, seen: set[str]) -> Line:
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return BadLine(index, None, "invalid_json_line", f"Line {index + 1} is not valid JSON.")
    if not isinstance(request, dict):
        return BadLine(index, None, "invalid_json_line", f"Line {index + 1} is not a JSON object.")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(index, None, "missing_custom_id", f"Line {index + 1} has no custom_id (a non-empty string).")
    refusal = _refusal(request, custom_id, endpoint, seen)
    if refusal is not None:
        return BadLine(index, custom_id, *refusal)
    seen.add(custom_id)
    return BatchLine(index, custom_id, json.dumps(request["body"], ensure_ascii=False).encode())


def _refusal(request: dict[str, Any], custom_id: str, endpoint: str, seen: set[str]) -> tuple[str, str] | None:
    """(code, message) of what is wrong with a line that has a custom_id, or None."""
    if len(custom_id) > MAX_CUSTOM_ID:
        return "invalid_custom_id", f"custom_id is longer than {MAX_CUSTOM_ID} characters."
    if custom_id in seen:
        return "duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line of the file."
    if request.get("method") != "POST":
        return "invalid_method", f"method must be 'POST', got {request.get('method')!r}."
    if request.get("url") != endpoint:
        return "mismatched_url", f"url must be the batch's endpoint {endpoint!r}, got {request.get('url')!r}."
    body = request.get("body")
    if not isinstance(body, dict):
        return "invalid_body", "body must be a JSON object (the request to send to the endpoint)."
    if body.get("stream"):
        return "stream_unsupported", "A batch request cannot be streamed: leave `stream` out or false."
    return None
