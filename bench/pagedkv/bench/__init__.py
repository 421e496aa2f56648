"""pagedkv's benchmarks and simulations, a part of their own (pagedkv-bench),
so that the service images carry none of them.

- ``scheduler``: ``pagedkv bench blocks``, ``scheduler``, ``cluster``,
  ``serve`` and ``memory``, the step profile, and the simulated executor
  (``executor_sim``) that the block benchmark, the step profile and the
  cluster simulation answer the real ``ExecutorScheduler`` with;
- ``cluster_sim``: ``pagedkv bench cluster-sim``, the discrete-event
  simulation of a routed cluster;
- ``routing``: ``pagedkv bench routing``, the routing policies on a local
  CPU cluster;
- ``executor``: the executor on a GPU (``python -m
  pagedkv.bench.executor.bench``), Hugging Face ``generate`` beside it, and
  its kernel profile;
- ``kernels``: ``pagedkv bench kernels``, the projections' GEMMs, the fused
  layer ops and the decode attention's launch-constant sweep.
"""
