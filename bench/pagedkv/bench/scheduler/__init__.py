"""Benchmarks of the scheduler side (``pagedkv bench ...``)."""
