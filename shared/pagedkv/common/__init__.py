"""Code shared by every pagedkv part: id types, KV cache specs, logging, the CLI.

Nothing here imports torch, triton or transformers.
"""
