"""uvicorn's access log without API keys: the value of every `api_key` query parameter becomes `***`.

The dashboard's feed takes its key as `?api_key=` (an EventSource cannot send a header), and uvicorn writes
each request's path with its query string. The parameter's name is compared decoded, as the server reads it
(`?api%5Fkey=` is the same parameter), so no spelling of it reaches the log.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote_plus

ACCESS_LOGGER = "uvicorn.access"
SECRET_PARAMETERS = frozenset({"api_key"})
REDACTED = "***"


def redact_query(text: str) -> str:
    """`text` (a path with its query string) with every secret parameter's value replaced by REDACTED."""
    path, mark, query = text.partition("?")
    if not mark:
        return text
    return path + "?" + "&".join(_redact_parameter(p) for p in query.split("&"))


def _redact_parameter(parameter: str) -> str:
    name, _, _ = parameter.partition("=")
    return f"{name}={REDACTED}" if unquote_plus(name).strip().lower() in SECRET_PARAMETERS else parameter


class RedactingFilter(logging.Filter):
    """Redacts every string argument of a record (uvicorn passes the path with its query as one), leaving the
    arguments' number and order alone: uvicorn's access formatter unpacks them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (a logger's own filter sees every record it logs)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())
