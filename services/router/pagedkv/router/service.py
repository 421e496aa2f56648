"""``RouterService``: the router's state and its decisions, without gRPC serving.

It keeps, from Redis: a ``ClusterSnapshot`` refreshed every
``refresh_interval_s`` (registry, members, leases, load reports) and the
prefix index, kept by a ``KVEventFollower`` task. ``route`` turns a request
into the schedulers to try, best first, each with the executor to hint; the
servicer forwards the call over ``channels`` (schedulers.py: opened lazily
and kept), through which Abort and GetStats go to the schedulers too.

While Redis cannot be read the router is *degraded*: it keeps routing on the
last snapshot and index (stale hints cost misses, never wrong answers: a
scheduler checks every hint) and recovers by itself.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

import redis.exceptions

from pagedkv.cluster.connection import connect, redacted
from pagedkv.cluster.keys import (
    DEFAULT_PREFIX,
    HOST_TIER_SUFFIX,
    Keys,
    host_tier_incarnation,
)
from pagedkv.common.bearer_tokens import TokenFile
from pagedkv.common.errors import InvalidArgument, Unavailable
from pagedkv.common.ids import BlockHash
from pagedkv.common.logging import get_logger
from pagedkv.common.loop_lag import LoopLag
from pagedkv.common.security import TlsConfig
from pagedkv.common.tasks import cancel_and_wait
from pagedkv.common.text import TextTokenizer
from pagedkv.common.text_prompts import PromptEncoder
from pagedkv.router.follower import KVEventFollower
from pagedkv.router.index import PrefixIndex, prompt_block_hashes
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.pending import PendingPrompts, merged
from pagedkv.router.placements import Placements, now_ms
from pagedkv.router.schedulers import Metadata, SchedulerChannels
from pagedkv.router.scoring import Choice, RoutingWeights, make_policy
from pagedkv.router.view import ClusterSnapshot, candidates_of, read_cluster
from pagedkv.v1 import scheduler_pb2

log = get_logger(__name__)

REDIS_ERRORS = (redis.exceptions.RedisError, OSError)


@dataclass(frozen=True)
class RouterConfig:
    redis_url: str
    prefix: str = DEFAULT_PREFIX
    policy: str = "kv"
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    model_dir: str | None = None  # for the tokenizer; default: the executors' model id
    refresh_interval_s: float = 0.1
    avoid_s: float = 2.0  # a scheduler whose call broke is routed around this long
    max_attempts: int = 3  # schedulers tried for one call before any chunk
    stats_timeout_s: float = 5.0
    scheduler_tls: TlsConfig | None = None  # TLS towards the schedulers (None: plaintext)
    scheduler_token: TokenFile | None = None  # presented to schedulers (None: callers' forwarded)


class Route(NamedTuple):
    """One scheduler to try, and the executor to hint ("" for none)."""

    member_id: str
    address: str  # the scheduler's
    executor: str
    cached_blocks: int
    score: float


class RouterService:
    """The router's cluster view, prefix index and routing decisions."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"
        self.keys = Keys(config.prefix)
        self.redis = connect(config.redis_url)
        self.policy = make_policy(config.policy, config.weights)
        self.index = PrefixIndex()
        self.follower = KVEventFollower(
            self.redis,
            self.index,
            self.keys,
            on_lag=metrics.observe_lag if metrics else None,
            on_reload=metrics.count_reload if metrics else None,
        )
        self.placements = Placements()
        self.pending = PendingPrompts()
        self.snapshot = ClusterSnapshot()
        self.degraded: str | None = "not read yet"
        self.tokenizer: TextTokenizer | None = None
        self._tokenizer_for: str | None = None
        self.prompts = PromptEncoder()  # text prompts, encoded off the loop
        self.max_model_len = 0  # the executors' longest, as last read (0: none read yet)
        self.live: dict[str, str] = {}  # request id -> scheduler address
        self.num_open_streams = 0
        self._avoid: dict[str, float] = {}  # member id -> monotonic until
        self._fallback = itertools.count()
        self.channels = SchedulerChannels(
            config.scheduler_tls, config.scheduler_token, config.stats_timeout_s
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._loop_errors: set[str] = set()
        self.loop_lag = LoopLag(metrics.observe_loop_lag) if metrics is not None else None
        if metrics is not None:
            metrics.watch(self)

    # -- life -----------------------------------------------------------------

    async def start(self) -> None:
        """Reads the cluster once (a Redis that does not answer yet is retried
        in the background) and starts the refresh and follow tasks."""
        if self.loop_lag is not None:
            self.loop_lag.start()
        await self._refresh()
        self._tasks = [
            asyncio.create_task(self._refresh_loop()),
            asyncio.create_task(self._follow_loop()),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        if self.loop_lag is not None:
            await self.loop_lag.stop()
        await self.channels.close()
        self.prompts.close()
        await self.redis.aclose()

    async def _refresh(self) -> None:
        try:
            self.snapshot = await read_cluster(self.redis, self.keys)
            await self.follower.sync(
                name
                for r in self.snapshot.records.values()
                for name in (r.incarnation_id, host_tier_incarnation(r.incarnation_id))
            )
        except REDIS_ERRORS as exc:
            if self.metrics is not None:
                self.metrics.count_redis_error()
            if self.degraded is None:
                log.warning("cannot read redis; routing on the last view", error=str(exc))
            self.degraded = f"redis {redacted(self.config.redis_url)}: {exc}"
            return
        if self.degraded is not None and self.degraded != "not read yet":
            log.info("cluster view restored")
        self.degraded = None
        self._load_tokenizer()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            try:
                await self._refresh()
            except Exception as exc:  # unreadable data: keep the last view, say so once
                self._loop_error("refresh", exc)

    async def _follow_loop(self) -> None:
        while True:
            try:
                if not await self.follower.poll() and not self.follower.cursors:
                    await asyncio.sleep(self.config.refresh_interval_s)
            except REDIS_ERRORS:
                if self.metrics is not None:
                    self.metrics.count_redis_error()
                await asyncio.sleep(self.config.refresh_interval_s)
            except Exception as exc:  # an entry that does not parse: reload at next sync
                self._loop_error("follow", exc)
                self.follower.reset()
                await asyncio.sleep(self.config.refresh_interval_s)

    def _loop_error(self, loop: str, exc: Exception) -> None:
        """Logs an unexpected error of a background loop (once per message)."""
        message = f"{type(exc).__name__}: {exc}"
        if message not in self._loop_errors:
            self._loop_errors.add(message)
            log.error("router loop error", loop=loop, error=message)

    def _load_tokenizer(self) -> None:
        """Loads the tokenizer once the model is known (text prompts are
        routed by load alone without one)."""
        records = self.snapshot.records
        if not records:
            return
        self.max_model_len = max(r.max_model_len for r in records.values())
        source = self.config.model_dir or next(iter(records.values())).model_id
        if source == self._tokenizer_for:
            return
        self._tokenizer_for = source
        try:
            self.tokenizer = TextTokenizer.from_model_dir(source)
        except Exception as exc:  # a broken tokenizer.json: route text by load
            log.warning(
                "cannot load the tokenizer; text prompts are routed by load", error=str(exc)
            )
            self.tokenizer = None

    # -- routing --------------------------------------------------------------

    def avoid(self, member_id: str, why: str) -> None:
        """Routes around ``member_id`` for ``avoid_s`` (its call just broke)."""
        log.info("routing around a scheduler", scheduler_id=member_id, why=why)
        self._avoid[member_id] = time.monotonic() + self.config.avoid_s

    def _avoided(self) -> set[str]:
        now = time.monotonic()
        for member_id in [m for m, until in self._avoid.items() if until <= now]:
            del self._avoid[member_id]
        return set(self._avoid)

    async def _prompt(self, request: scheduler_pb2.GenerateRequest) -> list[int] | None:
        """The prompt's ids with the resumed ones; a text prompt is encoded
        off the event loop, and refused first when it cannot fit the longest
        max_model_len of the executors. None (route by load): no tokenizer,
        or more ids than that max_model_len (the scheduler refuses them)."""
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("prompt: set text or token_ids")
        if which == "text":
            if self.tokenizer is None or not self.max_model_len:
                return None
            ids = await self.prompts.encode(request.text, self.tokenizer, self.max_model_len)
        else:
            ids = list(request.token_ids.ids)
        ids += request.resumed_token_ids
        if self.max_model_len and len(ids) > self.max_model_len:
            return None  # the scheduler refuses it: no hashing it here
        return ids

    async def route(self, request: scheduler_pb2.GenerateRequest) -> list[Route]:
        """The schedulers to try for ``request``, best first: the owner of the
        best-ranked executor (with it as the hint), then the best executor of
        each other member. With no executor to rank, the live members in turn,
        without a hint. Unavailable when no member is live."""
        tokens = await self._prompt(request)
        snapshot, avoided = self.snapshot, self._avoided()
        candidates = candidates_of(snapshot, avoided, self.placements.correction)
        cached: dict[str, int] = {}
        on_host: dict[str, int] = {}
        hashes_of: dict[str, list[BlockHash]] = {}  # incarnation -> the prompt's hashes
        num_prompt_blocks = 0
        now = now_ms()
        if tokens is not None and candidates:
            groups: dict[tuple[str, int], list[str]] = {}
            for candidate in candidates:
                record = snapshot.records[candidate.address]
                groups.setdefault((record.model_id, record.block_size), []).append(
                    candidate.incarnation_id
                )
            for (model_id, block_size), incarnations in groups.items():
                hashes = prompt_block_hashes(tokens, model_id, block_size, request.cache_salt)
                num_prompt_blocks = max(num_prompt_blocks, len(hashes))
                held = self.index.match(hashes)
                depth = merged(held, self.pending.match(hashes, now))
                cached.update((i, depth[i]) for i in incarnations if i in depth)
                hashes_of.update((i, hashes) for i in incarnations)
                for i in incarnations:  # the host tier's blocks past the GPU's run
                    beyond = held.get(host_tier_incarnation(i), 0) - cached.get(i, 0)
                    if beyond > 0:
                        on_host[i] = beyond
        choices = self.policy.rank(candidates, cached, num_prompt_blocks, on_host)
        if choices and choices[0].candidate.incarnation_id in hashes_of:
            chosen = choices[0].candidate.incarnation_id
            self.pending.add(chosen, hashes_of[chosen], now)
        routes = self._routes(snapshot, choices, avoided)
        if not routes:
            detail = f" ({self.degraded})" if self.degraded else ""
            raise Unavailable(f"no scheduler is live in the cluster{detail}")
        self._count(request, choices, cached, num_prompt_blocks)
        return routes

    def _routes(
        self, snapshot: ClusterSnapshot, choices: list[Choice], avoided: set[str]
    ) -> list[Route]:
        routes: list[Route] = []
        seen: set[str] = set()
        for choice in choices:
            owner_id = choice.candidate.owner_id
            if owner_id in seen:
                continue
            seen.add(owner_id)
            member = snapshot.members[owner_id]
            routes.append(
                Route(
                    owner_id,
                    member.address,
                    choice.candidate.address,
                    choice.cached_blocks,
                    choice.score,
                )
            )
        others = sorted(m for m in snapshot.members if m not in seen and m not in avoided)
        if others:
            turn = next(self._fallback) % len(others)
            for member_id in others[turn:] + others[:turn]:
                routes.append(Route(member_id, snapshot.members[member_id].address, "", 0, 0.0))
        return routes

    def _count(
        self,
        request: scheduler_pb2.GenerateRequest,
        choices: list[Choice],
        cached: dict[str, int],
        num_prompt_blocks: int,
    ) -> None:
        best = choices[0] if choices else None
        if best is None:
            kind = "no_candidate"
        elif best.cached_blocks < max(cached.values(), default=0):
            kind = "load_over_cache"
        else:
            kind = "cache_hit" if best.cached_blocks else "cache_miss"
        if self.metrics is not None:
            self.metrics.count_request(self.policy.name)
            self.metrics.count_decision(kind, num_prompt_blocks, best.cached_blocks if best else 0)
        log.debug(
            "routed",
            request_id=request.request_id,
            policy=self.policy.name,
            decision=kind,
            prompt_blocks=num_prompt_blocks,
            candidates=[
                {
                    "executor": c.candidate.address,
                    "scheduler_id": c.candidate.owner_id,
                    "cached_blocks": c.cached_blocks,
                    "queued": c.candidate.num_queued,
                    "kv_usage": round(c.candidate.kv_usage, 3),
                    "score": round(c.score, 4),
                }
                for c in choices[:4]
            ],
        )

    def first_chunk(self, route: Route, chunk: scheduler_pb2.GenerateResponse) -> None:
        """Counts what the scheduler made of the hint (its first chunk says)."""
        if not route.executor or not chunk.HasField("placement"):
            return
        hint = chunk.placement.hint
        if hint != scheduler_pb2.PLACEMENT_HINT_NONE and self.metrics is not None:
            name = scheduler_pb2.PlacementHint.Name(hint).removeprefix("PLACEMENT_HINT_").lower()
            self.metrics.count_hint(name)

    # -- schedulers -----------------------------------------------------------

    async def abort(self, request_id: str, metadata: Metadata = ()) -> bool:
        """Aborts ``request_id`` on the scheduler this router sent it to, or
        on every live scheduler when it did not send it. ``metadata``: the
        caller's, passed on (its token, when the router has none of its own)."""
        address = self.live.get(request_id)
        addresses = [address] if address else [m.address for m in self.snapshot.members.values()]
        return await self.channels.abort(addresses, request_id, metadata)

    async def stats(
        self, metadata: Metadata, request: scheduler_pb2.GetStatsRequest
    ) -> scheduler_pb2.GetStatsResponse:
        """The live schedulers' stats summed, the cluster view and the
        router's state; ``metadata`` as for ``abort``; ``request`` (its
        peak reset) is passed on to each scheduler."""
        members = sorted(self.snapshot.members.values(), key=lambda m: m.member_id)
        response, unreachable = await self.channels.summed_stats(members, metadata, request)
        response.scheduler_id = self.router_id
        response.cluster.CopyFrom(self.snapshot.state())
        if self.degraded is not None:
            response.cluster.degraded = True
            response.cluster.detail = self.degraded
        response.router.CopyFrom(
            scheduler_pb2.RouterState(
                router_id=self.router_id,
                unreachable_scheduler_ids=unreachable,
                num_indexed_blocks=self.num_indexed_blocks,
                num_followed_executors=self.num_followed_executors,
                kv_event_lag_seconds=self.follower.lag_s,
                policy=self.policy.name,
            )
        )
        return response

    @property
    def num_indexed_blocks(self) -> int:
        return self.index.num_blocks()

    @property
    def num_followed_executors(self) -> int:
        """Executor incarnations followed (each also followed as its host
        tier, which is not counted again)."""
        return sum(1 for name in self.follower.cursors if not name.endswith(HOST_TIER_SUFFIX))
