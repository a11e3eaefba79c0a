"""Reading a batch's input: every kind of bad line is a line of the error file (never a failed batch), the first
holder of a custom_id runs, and only a file with no request or no JSON object at all fails the batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagegate.gateway.batches.lines import BadLine, BatchLine, InvalidInputFile, check_file, read_lines

CHAT = "/v1/chat/completions"


def request(custom_id: object = "a", url: str = CHAT, method: str = "POST", body: object = None) -> str:
    line = {"custom_id": custom_id, "method": method, "url": url, "body": {"model": "m"} if body is None else body}
    if custom_id is None:
        del line["custom_id"]
    return json.dumps(line)


def write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_each_bad_line_has_its_code_and_the_good_ones_keep_their_place(tmp_path: Path) -> None:
    source = write(tmp_path / "in.jsonl", request("a"), "{not json", "", request(None), request("a"),
                   request("b", url="/v1/completions"), request("c", method="GET"), request("d", body=[1]),
                   request("e", body={"model": "m", "stream": True}), request(7), "[1, 2]", request("f"))
    lines = list(read_lines(source, CHAT))
    good = [(line.index, line.custom_id) for line in lines if isinstance(line, BatchLine)]
    bad = [(line.index, line.custom_id, line.code) for line in lines if isinstance(line, BadLine)]
    assert good == [(0, "a"), (11, "f")]  # the blank line 2 is skipped but counted
    assert bad == [(1, None, "invalid_json_line"), (3, None, "missing_custom_id"), (4, "a", "duplicate_custom_id"),
                   (5, "b", "mismatched_url"), (6, "c", "invalid_method"), (7, "d", "invalid_body"),
                   (8, "e", "stream_unsupported"), (9, None, "missing_custom_id"), (10, None, "invalid_json_line")]
    assert json.loads(lines[0].body) == {"model": "m"}  # type: ignore[union-attr]
    assert check_file(source, CHAT).total == 11 and check_file(source, CHAT).bad == 9


@pytest.mark.parametrize(("content", "code"), [
    ("", "empty_file"), ("\n\n  \n", "empty_file"), ("a,b,c\n1,2,3\n", "invalid_file_format"),
    ('[{"custom_id": "a"}]\n', "invalid_file_format"), ("\xff\xfe binary", "invalid_file_format")])
def test_a_file_with_no_request_or_no_json_object_is_not_a_batch(tmp_path: Path, content: str, code: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(content.encode("latin-1"))
    with pytest.raises(InvalidInputFile) as refused:
        check_file(source, CHAT)
    assert refused.value.code == code


def test_reading_is_the_same_every_time(tmp_path: Path) -> None:
    source = write(tmp_path / "in.jsonl", *(request(f"r{i % 7}") for i in range(20)))
    assert list(read_lines(source, CHAT)) == list(read_lines(source, CHAT))
