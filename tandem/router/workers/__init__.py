"""The workers the router fronts: what it knows of each, and how it keeps that current.

`registry` holds each worker's health state (the circuit breaker: down after N failed probes
or requests, up after M good ones), its last polled load and the tokens the router sent it
since, grouped into pools by role; `health` polls every worker's /health and /load in the
background. Submodules are not imported here.
"""
