"""What several test files share: live servers and clusters started as a user starts them,
fake workers, recording proxies, network-namespace hosts, tiny models and GGUF files."""
