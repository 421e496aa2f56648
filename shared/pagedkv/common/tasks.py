"""Stopping background tasks for sure: ``cancel_and_wait``.

A background loop (a lease round, a Redis refresh, a mirror flush) is
stopped by cancelling its task and awaiting it. One cancellation is not
always enough: on Python 3.11 a ``CancelledError`` that meets a result in
the same turn of the loop can be swallowed below our code (``wait_for`` and
timeout contexts in libraries, the Redis client's among them), and the loop
then goes on to its next sleep as if nothing happened; awaiting it once more
waits for ever, and the process never exits. ``cancel_and_wait`` cancels
again until each task has ended, a bounded number of times.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

CANCEL_WAIT_S = 1.0
"""Seconds to wait for the tasks to end after each cancellation."""

CANCEL_ATTEMPTS = 5
"""Cancellations sent to a task before it is left running."""


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any] | None],
    *,
    wait: float = CANCEL_WAIT_S,
    attempts: int = CANCEL_ATTEMPTS,
) -> set[asyncio.Task[Any]]:
    """Cancels ``tasks`` (None entries are skipped) and waits up to ``wait``
    seconds for them to end, again while any is left, ``attempts`` times in
    all; returns the tasks still running after that (empty normally). What a
    task ended with, its exception included, is consumed here (a stopped
    loop's error is of no further use)."""
    every = [task for task in tasks if task is not None]
    pending = {task for task in every if not task.done()}
    for _ in range(attempts):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=wait)
    for task in every:
        if task in pending:
            task.cancel()  # left running: one more request, not awaited
        elif not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" report at exit
    return pending
