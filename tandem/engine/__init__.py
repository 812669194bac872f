"""Engine: block pool, KV cache manager and scheduler (torch-free), model runner, LLM engine.

This package's __init__ imports nothing, so `tandem.engine.block_hash` can be used by the
router without loading torch.
"""
