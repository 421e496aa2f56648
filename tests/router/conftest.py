"""The router tests share the cluster tests' private redis-server fixtures."""

from tests.cluster.conftest import redis_server, redis_url

__all__ = ["redis_server", "redis_url"]
