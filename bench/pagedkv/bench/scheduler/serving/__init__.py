"""``pagedkv bench serve``: request rates, latencies and a fixed batch against ``pagedkv serve``."""
