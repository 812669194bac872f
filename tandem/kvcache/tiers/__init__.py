"""KV tiers below the device pool: CPU memory, local disk, a cluster store."""
