"""Starting and watching processes: `tandem up`'s cluster, the child supervisor, network
namespaces for multi-host tests and benches, and local Redis / Mooncake servers for the KV tiers."""
