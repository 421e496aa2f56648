"""The executor: KV tensors and a transformers model behind the Executor gRPC API
(filled in by the executor work)."""
