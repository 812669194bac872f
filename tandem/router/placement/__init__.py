"""Placement: which worker of a pool serves each hop of a request (no HTTP server here).

`policies` decides (affinity key on a bounded-load consistent-hash `ring`, then kv_aware,
least_tokens, session or round_robin); `scoring` holds the token scores; `kv_index` is which
worker holds which KV blocks, kept current by `kv_events` polling the workers' event feeds;
`prompt_tokens` counts a prompt's tokens and `tokenize` asks a worker for its exact tokens;
`placement` glues a request to the policies and their metrics; `flags` are the policy flags
shared by `tandem route` and `tandem up`. Submodules are not imported here, so the flags can
be loaded without the rest.
"""
