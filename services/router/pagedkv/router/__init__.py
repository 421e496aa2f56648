"""The pagedkv router: places each request on the executor whose prefix cache
holds the longest part of its prompt, weighed against load, and forwards it to
the scheduler that holds that executor (see docs/routing.md).

Torch-free and stateless: everything it knows comes from Redis (the registry,
the leases, the schedulers' load reports and the KV event streams).
"""
