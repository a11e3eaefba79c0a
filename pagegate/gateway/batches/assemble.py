"""A finished batch's output and error files, in input order, from its input and its stored results.

Output lines are OpenAI's: `{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}`; a line the route refused has the same shape in the error file, and a line refused
before it ran (a bad line, or one the batch expired before running) has `"response": null` and an `error`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from pagegate.gateway.batches.lines import BadLine, Line
from pagegate.gateway.batches.store import LineResult, succeeded

EXPIRED_CODE = "batch_expired"


@dataclass
class Assembled:
    completed: int = 0  # lines in the output file
    failed: int = 0  # lines in the error file


def assemble(lines: Iterable[Line], results: Iterable[LineResult], output: BinaryIO, errors: BinaryIO,
             expired: bool = False) -> Assembled:
    """Write one line per answered request, in the order of `lines`; `results` come in that order too (at most one
    per line). A request with no result is left out (a cancelled batch's), or with `expired` written as expired."""
    counts = Assembled()
    pending = iter(results)
    result = next(pending, None)
    for line in lines:
        while result is not None and result.line < line.index:  # a result no line of the input has: never written
            result = next(pending, None)
        if isinstance(line, BadLine):
            errors.write(error_line(line.custom_id, line.code, line.message))
            counts.failed += 1
        elif result is not None and result.line == line.index:
            good = succeeded(result.status_code)
            (output if good else errors).write(response_line(result))
            counts.completed += good
            counts.failed += not good
        elif expired:
            errors.write(error_line(line.custom_id, EXPIRED_CODE,
                                    "This request could not be executed before the completion window expired."))
            counts.failed += 1
    return counts


def response_line(result: LineResult) -> bytes:
    head = json.dumps({"id": result.id, "custom_id": result.custom_id}, ensure_ascii=False)[:-1]
    return (f'{head}, "response": {{"status_code": {result.status_code}, "request_id": '
            f'{json.dumps(result.request_id)}, "body": ').encode() + result.body + b'}, "error": null}\n'


def error_line(custom_id: str | None, code: str, message: str) -> bytes:
    line = {"id": new_request_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


def new_request_id() -> str:
    return "batch_req_" + secrets.token_hex(16)
