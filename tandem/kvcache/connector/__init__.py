"""KV connectors: KV that comes from, or goes to, somewhere other than the local pool."""
