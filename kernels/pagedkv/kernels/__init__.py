"""Triton paged-attention kernels with torch oracles (filled in by the kernel work)."""
