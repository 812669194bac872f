"""A step's batch as the layers above and below the model runner share it.

The scheduler writes a `SchedulerOutput` and reads a `ModelRunnerOutput` (scheduler_output.py,
torch-free); the model runner and a model-running draft proposer both flatten scheduled chunks
into the same model inputs and attention metadata (prepared.py). Living below the engine, the
worker and the speculative proposers, these types let each of them import the others' data
without importing each other.
"""
