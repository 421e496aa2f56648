"""The scheduler's configuration: ``SchedulerConfig`` (what ``pagedkv
scheduler`` and ``pagedkv serve`` build from their flags) and, with Redis,
its ``ClusterConfig``. Plain values only: every part of the service reads
its settings from here, and nothing here imports the service."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.cluster.keys import DEFAULT_PREFIX
from pagedkv.common.security import TlsConfig
from pagedkv.common.step_contract import DEFAULT_PIPELINE_DEPTH, ONE_STEP


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    redis_url: str
    address: str = ""  # where this scheduler's API serves (its member record)
    lease_ttl: float = 3.0  # seconds; the member task runs every lease_ttl / 4
    prefix: str = DEFAULT_PREFIX
    drain_timeout: float = 10.0  # seconds running requests get when an executor is given up


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    executors: tuple[str, ...]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    executor_timeout: float = 120.0
    model_dir: str | None = None  # for the tokenizer; default: the executors' model id
    scheduler_id: str = ""
    # Steps in flight per executor (1: no async stepping).
    pipeline_depth: int = DEFAULT_PIPELINE_DEPTH
    # A Generate stream's pause after each message, seconds per open stream
    # (capped at 50 ms; 0: a message every step): see chunks.py.
    stream_pace_per_stream: float = 150e-6
    # Most decode steps one step message may ask for (windows.py). One step
    # here, unlike the CLI's default: see step_contract.ONE_STEP.
    decode_window: int = ONE_STEP
    # Whether an admitted request loads its prefix's host hits (host_tier.py,
    # HOST_LOADS): as the executor's measured costs say, always, or never.
    host_loads: str = "auto"
    # When a cached block goes to the host tier: written through in the step
    # after the one that computed it, or only when the GPU pool evicts it
    # (host_tier.py, HOST_OFFLOADS).
    host_offload: str = "eviction"
    # While an executor is idle, its pool's next blocks this many deep go to
    # the host tier ahead of their eviction (ExecutorScheduler.idle_step; 0:
    # off, the default until measured on a GPU).
    host_idle_offload_blocks: int = 0
    cluster: ClusterConfig | None = None  # with Redis: executors come from its registry
    executor_tls: TlsConfig | None = None  # mutual TLS towards the executors (None: plaintext)
