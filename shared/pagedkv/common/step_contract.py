"""The step contract's limits and defaults, each defined once.

A scheduler's step messages (``StepRequest``, protos/pagedkv/v1/executor.proto)
are encoded by ``pagedkv.scheduler.step_message`` and checked by
``pagedkv.executor.step_plan``; the scheduler's CLI sets how large a decode
window and how deep a pipeline it asks for; both gRPC ends size their
messages. Each value the two sides must agree on lives here, and both sides
(and the CLI's defaults) read it from here, so they cannot drift apart.

Plain integers only: the scheduler imports this, and nothing on its side may
pull in torch, triton or transformers.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The largest gRPC message of the Executor API, sent or received: the
executor's server and the scheduler's channel to it both set it as
``grpc.max_send_message_length`` and ``grpc.max_receive_message_length``.
gRPC's default (4 MiB) is too small: a step sends each new request's whole
history once (a resumed request's outputs too), so a step that admits many
long prompts carries millions of token ids (about 3 bytes each on the wire)."""

MAX_DECODE_STEPS = 64
"""The most decode steps one message may ask for (``num_decode_steps``): the
executor refuses more (INVALID_ARGUMENT naming the field), and the
scheduler's ``--decode-window`` is checked against it. A window runs its steps
back to back before it answers, so it bounds how long one message holds the
executor and how many rounds of samples its response holds; windows past 16
gave no more throughput on the H200 (tests/benchmarks/results/serve-sweep-windows-h200.md)."""

ONE_STEP = 1
"""A decode window of one step: one decode step per message, windows off.
On the wire ``num_decode_steps`` 0 (unset, as the encoder leaves it) means the
same. The smallest ``--decode-window``, and the default window of code that
builds a scheduler itself (``SchedulerConfig``): tests, simulations and
embedders get one step per message, whose samples come back step by step,
unless they ask for windows; windows are a throughput setting of the served
process (``DEFAULT_DECODE_WINDOW``)."""

DEFAULT_DECODE_WINDOW = 8
"""The scheduler CLI's default ``--decode-window`` (``pagedkv scheduler`` and
``pagedkv serve``): on the H200 windows of 8 serve a 64 x (512 -> 256) batch
1.9 times and a 256 one 1.8 times as fast as single steps, 16 no faster
(tests/benchmarks/results/serve-sweep-windows-h200.md)."""

DEFAULT_PIPELINE_DEPTH = 2
"""Steps in flight per executor, by default (``--pipeline-depth``,
``SchedulerConfig.pipeline_depth``): step N + 1 is scheduled and sent while
the executor runs step N, so the next request is usually waiting when a
step's device work is enqueued (the executor's step pipeline launches each
request as it arrives). 1: no async stepping. The scheduler CLI's default
with windows; with single steps it is ``SINGLE_STEP_PIPELINE_DEPTH``
(``default_pipeline_depth``)."""

SINGLE_STEP_PIPELINE_DEPTH = 4
"""The scheduler CLI's default ``--pipeline-depth`` with single steps
(``--decode-window 1``). A single step's device time is short next to the
host work around it (the executor's launch, the response's way back, the
scheduler's processing and the next step's scheduling), so two steps in
flight leave the device idle between steps. On the H200, single steps
served 64 x (512 -> 256) at 0.83x the windowed figure with 3 in flight and
0.92x with 4 (256 x: 0.92x and 0.98x; serve-sweep-h200.md); on a slower
host, 0.61x with 2 (256 x: 0.77x; serve-sweep-noisy-h200.md). The cost: a
sequence that stops, and the next request's admission, are seen up to 3
steps late (the steps' samples after a stop are dropped, never sent)."""


def default_pipeline_depth(decode_window: int) -> int:
    """The scheduler CLI's default ``--pipeline-depth`` for ``decode_window``."""
    return SINGLE_STEP_PIPELINE_DEPTH if decode_window <= ONE_STEP else DEFAULT_PIPELINE_DEPTH
