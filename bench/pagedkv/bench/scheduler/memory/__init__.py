"""``pagedkv bench memory``: paged KV against contiguous reservation, live."""
