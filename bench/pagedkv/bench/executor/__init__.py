"""The executor on a GPU: its decode step, Hugging Face ``generate`` beside
it, and where its step spends its time (needs pagedkv-executor, torch)."""
