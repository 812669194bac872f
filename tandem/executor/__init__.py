"""How the engine core reaches its workers: one in-process worker, or one process per rank."""
