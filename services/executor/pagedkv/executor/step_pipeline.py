"""The step stream's pipeline: step N + 1 is launched while the device runs step N.

A scheduler keeps two steps in flight on its stream (async stepping), so the
next request is usually waiting when a step's device work is enqueued. Made
strictly in turn (read, run, wait, respond), the device would idle while the
host answered step N and applied step N + 1. Here three threads share the
work:

- a reader takes requests off the stream as they arrive;
- a waiter waits for each launched step's last device event, in order;
- the stream's own thread launches each request as soon as it is read and
  answers each step as soon as the waiter says it is done.

Both report to one queue, so the stream's thread never polls. Responses go
out one per request, in order. A request refused at launch is answered after
every step launched before it, by the error that ends the stream (as in the
unpipelined stream). On the CPU a launch runs the whole step, and the order
of effects is the same.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

from pagedkv.executor.engine import Executor
from pagedkv.executor.launched import LaunchedStep
from pagedkv.v1 import executor_pb2


class _Done(NamedTuple):
    """The waiter's word: this step has finished on the device."""

    step: LaunchedStep


class _Failed(NamedTuple):
    """The stream or the wait raised: the pipeline ends with it."""

    error: BaseException


_END = object()  # the stream ended (reader), or the pipeline is over (waiter)


class StepPipeline:
    """Iterates the responses to a stream of step requests."""

    def __init__(
        self,
        executor: Executor,
        requests: Iterator[executor_pb2.StepRequest],
        session: int,
    ) -> None:
        self.executor = executor
        self.session = session
        self.events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.to_wait: queue.SimpleQueue[object] = queue.SimpleQueue()
        threading.Thread(
            target=self._read, args=(requests,), name="step-reader", daemon=True
        ).start()
        threading.Thread(target=self._wait, name="step-waiter", daemon=True).start()

    def _read(self, requests: Iterator[executor_pb2.StepRequest]) -> None:
        try:
            for request in requests:
                self.events.put(request)
        except BaseException as exc:  # cancelled, or a request that does not decode
            self.events.put(_Failed(exc))
        else:
            self.events.put(_END)

    def _wait(self) -> None:
        while (step := self.to_wait.get()) is not _END:
            assert isinstance(step, LaunchedStep)
            try:
                step.wait()
            except BaseException as exc:
                self.events.put(_Failed(exc))
                return
            self.events.put(_Done(step))

    def __iter__(self) -> Iterator[executor_pb2.StepResponse]:
        executor = self.executor
        launched: deque[LaunchedStep] = deque()
        try:
            while True:
                event = self.events.get()
                if isinstance(event, _Done):
                    assert event.step is launched[0]
                    yield executor.complete(launched.popleft())
                elif isinstance(event, executor_pb2.StepRequest):
                    try:
                        step = executor.launch(event, self.session)
                    except Exception:
                        yield from self._finish(launched)
                        raise
                    launched.append(step)
                    self.to_wait.put(step)
                elif isinstance(event, _Failed):
                    yield from self._finish(launched)
                    raise event.error
                else:
                    yield from self._finish(launched)
                    return
        finally:
            self.to_wait.put(_END)

    def _finish(self, launched: deque[LaunchedStep]) -> Iterator[executor_pb2.StepResponse]:
        """Answers every launched step, in order (waiting for each)."""
        while launched:
            yield self.executor.complete(launched.popleft())
