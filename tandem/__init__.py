"""tandem: LLM serving for agents.

`from tandem import LLM, SamplingParams` is the offline entry point. The heavy engine is
imported lazily so that torch-free parts (router, scheduler, block hashing) stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from tandem.llm import LLM
    from tandem.types import CompletionOutput, RequestOutput, SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from tandem import types

        return getattr(types, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
