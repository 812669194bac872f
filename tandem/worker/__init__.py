"""A rank: loads its part of the model, sizes and owns its KV cache, runs the model runner."""
