"""Request lanes (issue 60): online requests, and batch lines that run only in the capacity online traffic leaves.

The batch runner calls the API routes in-process with the lane in the ASGI scope's state; a client cannot set it
(no header or field maps to it), so nothing a client sends moves it ahead of, or behind, anyone else."""

from __future__ import annotations

from starlette.types import Scope

from pagegate.engine.tenants import BATCH as BATCH  # the engine's lanes (its scheduler orders by them)
from pagegate.engine.tenants import ONLINE as ONLINE
from pagegate.engine.tenants import Lane as Lane

LANE_STATE = "pagegate_lane"  # where the batch runner leaves the lane in the scope's state


def request_lane(scope: Scope) -> Lane:
    """The lane this request runs in: ONLINE unless the batch runner put it in BATCH."""
    return BATCH if scope.get("state", {}).get(LANE_STATE) == BATCH else ONLINE
