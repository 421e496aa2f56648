"""Schedulers and executors join a running cluster in any order: each
executor ends up in service on exactly one scheduler, every scheduler's stats
show the whole cluster, and greedy output equals Hugging Face's on each."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.executor.tiny_model import make_tiny_model
from tests.cluster.cluster_stack import Cluster, greedy, wait_until
from tests.executor.test_generation import hf_greedy

pytestmark = pytest.mark.slow  # members joining a cluster in every order

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("cluster") / "llama"
    make_tiny_model(path, "llama", seed=7)
    return path


def test_two_schedulers_and_three_executors_started_in_any_order_share_the_executors(
    model_dir: Path, redis_url: str
) -> None:
    with Cluster(model_dir, redis_url) as cluster:
        cluster.add_executor()
        first = cluster.add_scheduler()
        cluster.add_executor()
        second = cluster.add_scheduler()
        cluster.add_executor()
        wait_until(cluster.each_owned_once, what="each executor in service on one scheduler")
        wait_until(lambda: sorted(map(len, (first.owned(), second.owned()))) == [1, 2])
        addresses = sorted(e.target for e in cluster.executors)
        ids = sorted([first.scheduler_id, second.scheduler_id])
        for scheduler in (first, second):
            wait_until(
                lambda s=scheduler: (
                    [e.owner_id != "" for e in s.stats().cluster.executors] == [True] * 3
                )
            )
            view = scheduler.stats().cluster
            assert view.enabled and not view.degraded
            assert list(view.scheduler_ids) == ids
            assert [e.address for e in view.executors] == addresses
            assert all(e.owner_id in ids and e.epoch > 0 for e in view.executors)
            tokens = [
                t
                for chunk in scheduler.stub.Generate(greedy(PROMPT, 12), timeout=120)
                for out in chunk.outputs
                for t in out.token_ids
            ]
            assert tokens == hf_greedy(model_dir, PROMPT, 12)
