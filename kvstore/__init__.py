"""KV blocks: vLLM-identical block hashing and the LMCache-backed host/shared tiers."""
