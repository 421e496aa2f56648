"""pagedkv's OpenAI-compatible HTTP gateway (torch-free)."""
