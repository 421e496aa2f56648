"""The kernels on a GPU: ``pagedkv bench kernels``, the projections against
cuBLAS and the launch-constant sweep (needs pagedkv-kernels, torch)."""
