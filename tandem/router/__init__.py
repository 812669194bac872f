"""`tandem route`: one OpenAI endpoint in front of pools of `tandem serve` workers.

The router splits long requests into a prefill hop and a decode hop (prefill/decode
disaggregation), merges the two halves into one response, balances by tokens, watches worker
health and retries failures that happened before the client saw a byte. It imports nothing
heavy (no torch, no transformers, no tandem.engine) so it deploys on a small CPU box.
"""
