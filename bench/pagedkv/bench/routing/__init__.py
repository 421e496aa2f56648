"""``pagedkv bench routing``: the routing policies side by side on a local CPU
cluster (a router, its schedulers and executors started by ``pagedkv serve``)."""
