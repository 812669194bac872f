"""`tandem route`: one OpenAI endpoint in front of pools of `tandem serve` workers.

The router splits long requests into a prefill hop and a decode hop (prefill/decode
disaggregation), merges the two halves into one response, balances by tokens, watches worker
health and retries failures that happened before the client saw a byte. It imports nothing
heavy (no torch, no transformers, no tandem.engine) so it deploys on a small CPU box.

Subpackages, in the order a request meets them: `http` (the FastAPI app, the proxy that runs
one request's hops, HTTP to workers, the router's metrics), `placement` (which worker gets a
hop: policies, the bounded-load ring, the KV index fed by the workers' KV events, token
scores, prompt counting and the tokenize hop), `pd` (when to split a request and the two
hops' bodies, and merging their responses into one), `accounting` (prices, the usage ledger,
API keys and /v1/usage) and `workers` (the registry of workers with their health state and
load, and the health poller). `config` and `cli` stay at the top: every subpackage reads the
config, and the CLI assembles it.
"""
