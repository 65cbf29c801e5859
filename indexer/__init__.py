"""vLLM block hashing, KV-event decoding and the prefix index fed by those events."""
