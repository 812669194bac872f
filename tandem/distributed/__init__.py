"""How ranks cooperate on one model: tensor parallelism (and, later, pipeline and experts)."""
