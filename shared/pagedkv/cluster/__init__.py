"""The cluster control plane over Redis (torch-free, shared by executors,
schedulers and the router): key layout (``keys``), connections, the executor
registry, scheduler membership, leases with fencing epochs, and the
prefix-cache mirror with its KV event streams."""
