"""The router's HTTP face: the FastAPI app, and the request path from client to workers.

`app` builds the app and its state (endpoints, lifespan, error handlers). `proxy` admits one
client request and sends it down one of two paths: `direct` (one worker serves it whole) or
`pd_flow` (a prefill hop, then a decode hop that takes over the prefill's KV). Both open hops
through `hops`, relay a worker's stream through `relay` (which moves a stream to another
worker when its worker fails, with `migration`'s record of the tokens so far), answer streams
with `sse`'s response class, share the request's state in `call`, and close it through
`bookkeeping` (metrics, usage ledger, quota, admission slot, the log line). `upstream` is HTTP
to the workers (timeouts, retries before the first byte, SSE reading), and `metrics` is the
router's own Prometheus registry. Submodules are imported where used, not here, so importing
one piece of the router does not build all of it.
"""
