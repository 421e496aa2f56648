"""A real executor process on 127.0.0.1 and a small test driver for it.

``ExecutorProcess`` starts an executor (``python -m pagedkv.executor``, the
same as ``pagedkv executor``) in a subprocess and waits for
its readiness line. ``Driver`` plays a naive scheduler over the gRPC API: it
hands out blocks from a free list (no prefix cache), schedules every
unfinished request in every step (prompt chunks and decodes mixed), and
collects the samples.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from tests.processes import ServedProcess

GREEDY = common_pb2.SamplingParams(temperature=0.0)


class ExecutorProcess(ServedProcess):
    """``python -m pagedkv.executor`` (on the CPU by default) with a free port;
    ``stub`` is its Executor stub."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        backend: str = "torch",
        device: str = "cpu",
        num_blocks: int = 256,
        extra_args: tuple[str, ...] = (),
        timeout: float = 180.0,
    ) -> None:
        command = [sys.executable, "-m", "pagedkv.executor", "--model", str(model_dir)]
        command += ["--port", "0", "--device", device, "--num-blocks", str(num_blocks)]
        command += ["--kernel-backend", backend, *extra_args]
        super().__init__(command, timeout)
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)


@dataclass
class Sequence:
    seq_id: str
    row: int
    prompt: list[int]
    max_new_tokens: int
    sampling: common_pb2.SamplingParams
    blocks: list[list[int]]  # per group
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def history(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class Driver:
    """A naive scheduler over one executor (owner ``test``, epoch 1 by default)."""

    def __init__(
        self, stub: executor_pb2_grpc.ExecutorStub, owner_id: str = "test", epoch: int = 1
    ) -> None:
        self.stub = stub
        self.info = stub.GetInfo(executor_pb2.GetInfoRequest())
        self.owner = common_pb2.Owner(owner_id=owner_id, epoch=epoch)
        stub.Reset(executor_pb2.ResetRequest(owner=self.owner))
        self.num_groups = len(self.info.kv_cache_groups)
        self.block_size = self.info.block_size
        self.free_blocks = list(range(1, self.info.num_blocks))
        self.free_rows = list(range(self.info.max_num_rows))
        self.step_id = 0
        self.responses: list[executor_pb2.StepResponse] = []

    def add(
        self,
        seq_id: str,
        prompt: list[int],
        max_new_tokens: int,
        sampling: common_pb2.SamplingParams = GREEDY,
    ) -> Sequence:
        return Sequence(
            seq_id,
            self.free_rows.pop(0),
            list(prompt),
            max_new_tokens,
            sampling,
            [[] for _ in range(self.num_groups)],
        )

    def step(
        self,
        seqs: list[Sequence],
        chunk_size: int | None = None,
        continue_from_sampled: bool = True,
        freed: list[Sequence] = (),  # type: ignore[assignment]
    ) -> executor_pb2.StepResponse:
        """One step over every unfinished sequence of ``seqs``: the next prompt
        chunk (``chunk_size`` tokens at most) or one decode."""
        request = executor_pb2.StepRequest(owner=self.owner, step_id=self.step_id)
        self.step_id += 1
        for seq in freed:
            request.freed_rows.append(seq.row)
            self._release(seq)
        entries = [s for s in seqs if not s.done]
        entries.sort(key=lambda s: s.sent)  # new requests come first
        for seq in entries:
            if not seq.sent:
                request.new_requests.add(
                    seq_id=seq.seq_id,
                    row=seq.row,
                    prompt_token_ids=seq.prompt,
                    sampling=seq.sampling,
                )
            else:
                request.rows.append(seq.row)
        samplers = []
        for seq in entries:
            c = seq.num_computed
            remaining = seq.history - c
            decode = bool(seq.output) and remaining == 1
            s = remaining if chunk_size is None or decode else min(chunk_size, remaining)
            cont = decode and continue_from_sampled
            request.num_computed_tokens.append(c)
            request.num_scheduled_tokens.append(s)
            request.continue_from_sampled.append(cont)
            needs_sample = c + s == seq.history
            request.needs_sample.append(needs_sample)
            if decode and not cont:
                request.token_ids.append(seq.output[-1])
            needed = -(-(c + s) // self.block_size)
            for group in seq.blocks:
                start = 0 if not seq.sent else len(group)
                new = [self.free_blocks.pop(0) for _ in range(needed - len(group))]
                group.extend(new)
                request.block_table_starts.append(start)
                request.new_block_counts.append(len(group) - start)
                request.new_block_ids.extend(group[start:])
            samplers.append((seq, s, needs_sample))
        response = self.stub.Step(request)
        self.responses.append(response)
        sampled = iter(zip(response.sampled_token_ids, response.sampled_logprobs, strict=True))
        for seq, s, needs_sample in samplers:
            seq.sent = True
            seq.num_computed += s
            if needs_sample:
                token, logprob = next(sampled)
                seq.output.append(token)
                seq.logprobs.append(logprob)
        return response

    def _release(self, seq: Sequence) -> None:
        for group in seq.blocks:
            self.free_blocks.extend(group)
            group.clear()
        self.free_rows.append(seq.row)

    def run(
        self,
        seqs: list[Sequence],
        chunk_size: int | None = None,
        continue_from_sampled: bool = True,
    ) -> list[list[int]]:
        """Steps until every sequence has its tokens, then frees them all."""
        while any(not s.done for s in seqs):
            self.step(seqs, chunk_size, continue_from_sampled)
        self.free(seqs)
        return [s.output for s in seqs]

    def free(self, seqs: list[Sequence]) -> None:
        self.stub.Free(executor_pb2.FreeRequest(owner=self.owner, rows=[s.row for s in seqs]))
        for seq in seqs:
            self._release(seq)
