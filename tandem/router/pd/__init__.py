"""Prefill/decode disaggregation as data: when to split a request, and how to make one answer.

`split` decides whether a request is split and builds the prefill and decode hops' bodies
(the `kv_transfer_params` protocol with the workers); `merge` turns the two workers' replies
or streams into one response with one id, every token once and usage counted once. Both are
pure functions on dicts; the proxy in `router.http` runs the hops. Submodules are not
imported here.
"""
