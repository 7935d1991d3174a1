"""What prepares a worker: the embedded default model (and later FP8 snapshots, kernel caches)."""
