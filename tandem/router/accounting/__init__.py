"""Accounting: who is calling, what each response costs, and the ledger of what was served.

`auth` checks API keys and names the caller, `pricing` turns usage into a price (cached
prompt tokens discounted), `ledger` writes one SQLite row per finished request off the
request path, `accounting` ties them together for the proxy, `usage_api` answers
GET /v1/usage, `datafile` reads the operator's JSON / YAML files, and `flags` are the
accounting flags shared by `tandem route` and `tandem up`. Submodules are not imported here,
so the flags can be loaded without the rest.
"""
