"""The router's HTTP face: the FastAPI app, and the proxy that carries a request to workers.

`app` builds the app and its state (endpoints, lifespan, error handlers), `proxy` runs one
client request through its hops (whole on one worker, or prefill then decode) and streams
the merged answer back, `upstream` is HTTP to the workers (timeouts, retries before the first
byte, SSE reading), and `metrics` is the router's own Prometheus registry, recorded along the
request path. Submodules are imported where used, not here, so importing one piece of the
router does not build all of it.
"""
