"""The step stream's pipeline: step N + 1 is launched while the device runs step N.

A scheduler keeps two steps in flight on its stream (async stepping), so the
next request is usually waiting when a step's device work is enqueued. Made
strictly in turn (read, run, wait, respond), the device would idle while the
host answered step N and applied step N + 1. Here three threads share the
work, each in message order:

- the launcher takes each request off the stream as it arrives and launches
  it at once (``Executor.launch``: validated, applied, its device work
  enqueued), so a request never waits behind a response being sent;
- the completer waits for each launched step's last device event and makes
  its response (``Executor.complete``);
- the stream's own thread sends the responses.

Responses go out one per request, in order. A request refused at launch is
answered, after every step launched before it, by the error that ends the
stream (as in an unpipelined stream); nothing after it is read. On the CPU
a launch runs the whole step, and the order of effects is the same.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import NamedTuple

from pagedkv.executor.engine import Executor
from pagedkv.executor.launched import LaunchedStep
from pagedkv.v1 import executor_pb2


class _Failed(NamedTuple):
    """The stream, a launch or a wait raised: the pipeline ends with it."""

    error: BaseException


_END = object()  # the stream ended, or the pipeline is over


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
        self.stopped = threading.Event()  # the stream's consumer has gone
        self.launched: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.responses: queue.SimpleQueue[object] = queue.SimpleQueue()
        threading.Thread(
            target=self._launch, args=(requests,), name="step-launcher", daemon=True
        ).start()
        threading.Thread(target=self._complete, name="step-completer", daemon=True).start()

    def _launch(self, requests: Iterator[executor_pb2.StepRequest]) -> None:
        end: object = _END  # what the completer gets last, whatever ends the loop
        try:
            for request in requests:
                if self.stopped.is_set():
                    break
                self.launched.put(self.executor.launch(request, self.session))
        except BaseException as exc:  # refused, cancelled, or undecodable
            end = _Failed(exc)
        finally:
            self.launched.put(end)

    def _complete(self) -> None:
        while True:
            item = self.launched.get()
            if isinstance(item, LaunchedStep):
                try:
                    item = self.executor.complete(item)
                except BaseException as exc:
                    item = _Failed(exc)
            self.responses.put(item)
            if not isinstance(item, executor_pb2.StepResponse):
                return

    def __iter__(self) -> Iterator[executor_pb2.StepResponse]:
        try:
            while True:
                item = self.responses.get()
                if isinstance(item, executor_pb2.StepResponse):
                    yield item
                elif isinstance(item, _Failed):
                    raise item.error
                else:
                    return
        finally:
            self.stopped.set()
