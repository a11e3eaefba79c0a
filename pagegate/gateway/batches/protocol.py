"""The Files and Batch APIs' shapes, as OpenAI writes them: the request that creates a batch, and the file, batch
and list objects the routes answer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from pagegate.gateway.batches.store import BatchRecord, FileRecord
from pagegate.gateway.protocol import StrictModel

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
UPLOAD_PURPOSE = "batch"  # the one purpose a client uploads for; batch outputs are "batch_output"
COMPLETION_WINDOW_S = 24 * 3600
MIN_TTL_S, MAX_TTL_S = 3600, 30 * 24 * 3600  # what `expires_after.seconds` may say (OpenAI's bounds)
DEFAULT_TTL_S = MAX_TTL_S  # a batch file (input or output) is kept 30 days unless told otherwise (OpenAI's)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class ExpiresAfter(StrictModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_TTL_S, le=MAX_TTL_S)


class BatchCreateRequest(StrictModel):
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs")
        if any(len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE for key, value in metadata.items()):
            raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters, values at most {MAX_METADATA_VALUE}")
        return metadata


def file_object(record: FileRecord) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": record.created_at,
            "expires_at": record.expires_at, "filename": record.filename, "purpose": record.purpose,
            "status": "processed", "status_details": None}


def deleted_file(file_id: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "deleted": True}


def batch_object(record: BatchRecord) -> dict[str, Any]:
    errors = {"object": "list", "data": record.errors} if record.errors else None
    return {"id": record.id, "object": "batch", "endpoint": record.endpoint, "errors": errors,
            "input_file_id": record.input_file_id, "completion_window": record.completion_window,
            "status": record.status, "output_file_id": record.output_file_id, "error_file_id": record.error_file_id,
            "created_at": record.created_at, "in_progress_at": record.in_progress_at,
            "expires_at": record.expires_at, "finalizing_at": record.finalizing_at,
            "completed_at": record.completed_at, "failed_at": record.failed_at, "expired_at": record.expired_at,
            "cancelling_at": record.cancelling_at, "cancelled_at": record.cancelled_at,
            "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
            "metadata": record.metadata}


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of a list, with OpenAI's cursor fields (`after=last_id` asks for the next page)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
