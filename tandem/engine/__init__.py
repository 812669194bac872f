"""Engine: block pool, KV cache manager and scheduler (torch-free), engine core, LLM engine."""
