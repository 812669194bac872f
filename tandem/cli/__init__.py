"""The `tandem` command line: the command table (`main`). Nothing in tandem imports it; the
flags it offers come from tables in `tandem.flags` and beside each tool and server."""
