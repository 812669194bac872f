"""The one error the memory plan raises for bad input.

A `ValueError`, so `tandem.cli.main` prints it as `tandem: error: ...` with a non-zero exit
and no traceback, like every other command's input errors.
"""

from __future__ import annotations


class PlanError(ValueError):
    """Input the plan cannot honour: unsupported architecture, bad parallelism, no fit."""
