"""Offline tools that train models for tandem to serve (an EAGLE-3 draft head for a target).

A tool, not the runtime: nothing under engine, worker, spec or server imports this package;
it drives tandem through its public `LLM` like any other user would.
"""
