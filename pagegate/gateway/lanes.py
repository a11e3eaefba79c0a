"""Request lanes (issue 60): online requests, and batch lines that run only in the capacity online traffic leaves.

The batch runner calls the API routes in-process with the lane in the ASGI scope's state; a client cannot set it
(no header or field maps to it), so nothing a client sends moves it ahead of, or behind, anyone else."""

from __future__ import annotations

from typing import Literal

from starlette.types import Scope

Lane = Literal["online", "batch"]
ONLINE: Lane = "online"
BATCH: Lane = "batch"
LANE_STATE = "pagegate_lane"  # where the batch runner leaves the lane in the scope's state


def request_lane(scope: Scope) -> Lane:
    """The lane this request runs in: ONLINE unless the batch runner put it in BATCH."""
    return BATCH if scope.get("state", {}).get(LANE_STATE) == BATCH else ONLINE
