"""pagedkv client SDK for the Scheduler gRPC service (filled in by the SDK work)."""
