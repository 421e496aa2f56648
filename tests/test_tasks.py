"""Background tasks are stopped for sure: a task that swallows a
cancellation (as a library's timeout can, on Python 3.11) is cancelled again
until it ends, and a task that will not end is reported, not waited for."""

from __future__ import annotations

import asyncio

from pagedkv.common.tasks import cancel_and_wait


def test_a_task_that_swallows_one_cancellation_is_cancelled_again() -> None:
    async def run() -> tuple[set[asyncio.Task[None]], int]:
        swallowed = 0

        async def loop() -> None:
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed += 1  # lost, as below a library's timeout

        task = asyncio.create_task(loop())
        await asyncio.sleep(0)
        left = await cancel_and_wait([task, None], wait=0.05)
        assert task.cancelled()
        return left, swallowed

    left, swallowed = asyncio.run(run())
    assert left == set() and swallowed == 1


def test_a_task_that_never_ends_is_returned_after_the_attempts() -> None:
    async def run() -> int:
        stop = asyncio.Event()
        cancellations = 0

        async def stubborn() -> None:
            nonlocal cancellations
            while not stop.is_set():
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    cancellations += 1

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        left = await cancel_and_wait([task], wait=0.01, attempts=3)
        assert left == {task}
        stop.set()
        await asyncio.sleep(0)  # the last request lands
        await asyncio.wait([task], timeout=1)
        return cancellations

    assert asyncio.run(run()) == 4  # three attempts and the parting request


def test_an_ended_tasks_error_is_consumed() -> None:
    async def run() -> None:
        async def boom() -> None:
            raise RuntimeError("boom")

        task = asyncio.create_task(boom())
        await asyncio.sleep(0)
        assert await cancel_and_wait([task]) == set()
        assert isinstance(task.exception(), RuntimeError)

    asyncio.run(run())
