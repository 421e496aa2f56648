"""The pagedkv scheduler: KV block accounting, prefix caching and batching.

CPU only: nothing under this package imports torch, triton, transformers or
the kernels (a test enforces it).
"""
