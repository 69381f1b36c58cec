"""Engine: scheduling, KV-cache management, sampling and detokenization."""
