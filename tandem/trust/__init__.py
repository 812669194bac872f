"""tandem's trust boundary: what a client may send, what only a peer may send, how a peer proves it.

Three kinds of caller reach a tandem process, and each is told apart at the edge, before a
request body reaches any handler:

- **Clients** call the router's `/v1/*` (with an API key when `--api-keys` is on) or a worker
  that runs without a cluster secret. Every field they send is untrusted: sampling parameters
  are range-checked (tandem/edge/openai_protocol.py), text must be valid Unicode
  (tandem/edge/limits.py), and the fields tandem uses between its own processes
  (`fields.INTERNAL_FIELDS`: the prefill/decode handoff's `kv_transfer_params`, which also
  carries first-token handoffs and migrated streams) never come from them: the router strips
  them from every client body and sets its own, and a worker refuses them (403) on any request
  a peer did not sign.
- **Peers** are tandem's own processes: the router calling its workers, and workers fetching
  each other's KV. They share one **cluster secret** (`--cluster-secret` or env
  `TANDEM_CLUSTER_SECRET`; `tandem up` makes one per cluster and hands it to every process in
  its environment). Over HTTP a peer signs each request (`peer.py`: HMAC-SHA256 of the method,
  path, a time stamp, a nonce and the body's SHA-256, under a key derived from the secret);
  a worker with a secret answers 401 to anything unsigned but `/health`. On the KV port both
  directions are signed (tandem/kvcache/transfer/wire.py): a decode worker talks only to a
  prefill worker that proves it knows the secret, and a handle names a lease, never a file or
  block ids: the prefill side maps the lease to its own blocks and shared-memory segment.
- **Operators** use the control plane: the router's `/workers/reload`, `/workers/ID/drain`
  and `/resume`, and a worker's `/reset_prefix_cache`, `/kv/release`, `/kv/events` and
  `/kv/snapshot`. These need `Authorization: Bearer ADMIN_KEY` (`--admin-key`, else the
  cluster secret) or a peer's signature (`access.py`). `/health` is always open;
  `/metrics`, `/workers`, `/load` and `/openapi.json` are open while no key of any kind is
  configured, closed to all but operators and peers once one is, unless `--public-metrics`
  opens them (the `/dashboard` page holds no data and asks for the admin key it needs).

Tenants: with API keys, the router gives each identity a cache salt that only it can make
(`fields.tenant_salt`: an HMAC of the identity under the cluster secret), so a client that
reaches a worker some other way cannot name another tenant's salt and time its cache.

The modules here import neither torch nor the engine: the router and the API process use
them, and so do the KV transfer threads.
"""
