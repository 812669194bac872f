"""Anthropic Messages request bodies as pydantic models: what `/v1/messages` checks, and how.

Top-level fields are models; content blocks are checked one at a time by their `type`
(`content_block`), so that a bad block is refused with its own location
(`messages.3.content.1.input`) and an unknown block type by name, instead of pydantic's
account of every union member it tried. Unknown fields are ignored, as Anthropic adds
optional ones with each beta (`context_management`, `output_config`, ...); a known field of
the wrong type or out of range is a 400. Torch-free: the router imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.edge.errors import APIError, bad_request, validation_error
from tandem.edge.openai_protocol import MAX_TOKENS_BOUND, CacheControl
from tandem.edge.protocols.base import CHAT_EXTRAS


class AnthropicModel(BaseModel):
    # As the OpenAI models: unknown fields ignored, NaN and infinities refused on every float.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ThinkingBlock(AnthropicModel):
    """An assistant's reasoning sent back in history (its `signature` is Anthropic's; ignored)."""

    type: Literal["thinking"]
    thinking: str


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=512)
    name: str = Field(min_length=1, max_length=512)
    input: dict[str, Any]  # a JSON object, as Anthropic requires
    cache_control: CacheControl | None = None


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=512)
    content: str | list[Any] | None = None  # text blocks (images are refused, checked per block)
    is_error: bool = False
    cache_control: CacheControl | None = None


class ToolDefinition(AnthropicModel):
    """A client tool (`type` absent or "custom"); Anthropic's server tools are not modelled."""

    name: str = Field(min_length=1, max_length=512)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # structured outputs: the call's input always validates


class OutputFormat(AnthropicModel):
    """Structured outputs' `output_format` (or `output_config.format`): the reply's text is JSON
    that validates against `schema`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    format: OutputFormat | None = None


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1)
    disable_parallel_tool_use: bool = False


class ThinkingConfig(AnthropicModel):
    # "enabled", "adaptive" or "disabled"; a newer mode is taken as a request to think.
    type: str
    budget_tokens: int | None = None


class Metadata(AnthropicModel):
    user_id: str | None = None


class InputMessage(AnthropicModel):
    # "system" inside `messages` is a mid-conversation system message: Claude Code (2.1.x,
    # beta mid-conversation-tool-changes) sends its environment and deferred tools as one.
    role: Literal["user", "assistant", "system"]
    content: str | list[Any]  # blocks, each checked by `content_block`


class CountTokensRequest(AnthropicModel):
    """`/v1/messages/count_tokens`: the prompt half of a Messages request."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[Any] | None = None  # a string or text blocks
    tools: list[Any] | None = None  # each checked by `tool_definition`
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None  # top level: a breakpoint on the last block


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_BOUND)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # the vocabulary bounds it on the worker
    stream: bool = False
    metadata: Metadata | None = None
    output_format: OutputFormat | None = None
    output_config: OutputConfig | None = None


# The fields the adapter reads; any other (`context_management`, `container`,
# `service_tier`, ...) is ignored, and logged once.
KNOWN_FIELDS = frozenset(MessagesRequest.model_fields) | frozenset(CHAT_EXTRAS)

M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], data: Any, loc: Sequence[str | int] = ()) -> M:
    """`data` as `model`, or the 400 naming the first problem at `loc` + its own location."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": (*loc, *e.get("loc", ()))} for e in exc.errors()]
        raise validation_error(errors) from None


def where(loc: Sequence[str | int]) -> str:
    return ".".join(str(part) for part in loc)


def block_type(block: Any, loc: Sequence[str | int]) -> str:
    """A content block's `type`; 400 for anything that is not an object with one."""
    if not isinstance(block, dict):
        raise bad_request(f"'{where(loc)}' must be a content block object, got {type(block).__name__}",
                          where(loc), "invalid_value")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad_request(f"'{where(loc)}.type' must be a string naming the block type",
                          f"{where(loc)}.type", "invalid_value")
    return kind


def text_only(kind: str, loc: Sequence[str | int]) -> APIError:
    return bad_request(f"'{where(loc)}' is a {kind} block: this model reads text only",
                       where(loc), "unsupported_content")


def unknown_block(kind: str, loc: Sequence[str | int], allowed: str) -> APIError:
    return bad_request(f"'{where(loc)}' has block type {kind!r}, which is not supported here "
                       f"(supported: {allowed})", f"{where(loc)}.type", "invalid_value")
