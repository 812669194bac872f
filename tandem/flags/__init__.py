"""Flags as data: the table mechanism every command builds its parser from (`table`), the
engine, model, server and prefill/decode tables with the configs they build (`engine`), and the
request-limit table (`limits`). Below the command line, the launcher, the router and the
benches, which all take these flags; it imports nothing of theirs."""
