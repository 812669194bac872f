"""The KV cache beyond one engine: handoffs between workers (and, later, CPU / disk / cluster tiers)."""
