"""Calls the gateway finishes in the background - the Releases of ended or moved requests - and
waits for at shutdown, so that they reach the services before the channels close."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine

_tasks: set[asyncio.Task] = set()


def spawn(coro: Coroutine) -> asyncio.Task:
    """Runs coro to its end even if whoever started it is cancelled."""
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def drain(timeout: float) -> None:
    """At shutdown: until the background calls are done (or timeout)."""
    if _tasks:
        await asyncio.wait(set(_tasks), timeout=timeout)
