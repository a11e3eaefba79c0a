"""An event loop the serving tests drive by hand, ended as asyncio.run ends its own."""

from __future__ import annotations

import asyncio


def end_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on the loop, let it finish, close the loop."""
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.wait(left))
    loop.close()
