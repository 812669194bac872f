"""OpenAI request bodies as pydantic models, and the mapping to SamplingParams.

Field names and defaults are OpenAI's, plus the sampling extras vLLM accepts (`top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, ...), so a client written for either works
unchanged. Unknown fields are ignored rather than refused: OpenAI keeps adding optional
fields (`store`, `metadata`, `service_tier`) that say nothing to a local engine.
Responses are built as plain dicts where they are assembled (tandem/server/serving_*.py).
It lives outside `tandem.server` because the router documents its /v1 bodies with the same
models (tandem/router/http/openapi.py), and the router imports nothing of the server.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.types import SEED_MAX, SEED_MIN, SamplingParams

_MAX_TOP_LOGPROBS = 20
MAX_N = 128
# Token counts: anything past int32 is far beyond any context and would only overflow a
# tensor or a C int somewhere downstream; the context-length check refuses what is left.
MAX_TOKENS_BOUND = 2**31 - 1
MAX_STOP_TOKEN_IDS = 1024


class OpenAIModel(BaseModel):
    # allow_inf_nan=False: Python's json accepts the literals NaN / Infinity / -Infinity and
    # pydantic's lax mode the strings "NaN", "inf", ...; a NaN or infinite temperature or
    # repetition_penalty got past `< 0` checks (any comparison with NaN is False) and
    # answered 200 with empty output (tests/security/test_hostile_params.py). Refused on
    # every float field, nested models included.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIModel):
    name: str
    arguments: str = ""


class ToolCallIn(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class CacheControl(OpenAIModel):
    """A cache breakpoint on a content part (Anthropic's `cache_control`, which OpenAI-compatible
    gateways accept on chat parts too): the prompt up to here is worth keeping."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] | None = None


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, sent back as the reply gave it (`reasoning_content`, or
    # `reasoning` as newer vLLM names it): templates of thinking models (Kimi K2.5, Qwen3,
    # DeepSeek) render it for the tool-call rounds of the turn in progress.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def reasoning_text(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def has_cache_breakpoint(self) -> bool:
        return isinstance(self.content, list) and any(p.cache_control is not None for p in self.content)

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type not in ("text", "input_text"):
                raise ValueError(f"content parts of type {part.type!r} are not supported; this model reads text only")
            texts.append(part.text or "")
        return "\n".join(texts)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(OpenAIModel):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # `schema` is a pydantic BaseModel attribute: the field is read under its alias.
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's text / json_object / json_schema, and tandem's regex and grammar (Lark or EBNF,
    as SGLang's `ebnf`)."""

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JSONSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None
    syntax: Literal["lark", "ebnf"] = "lark"


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` field: one constraint, whatever the endpoint."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=1024)
    grammar: str | None = None


class SamplingFields(OpenAIModel):
    """What chat and completion requests share."""

    model: str | None = None
    # OpenAI's bound; each sequence costs memory before the engine sees the request, so an
    # unbounded n was a way to run the server out of memory (found by fuzzing).
    n: int = Field(default=1, ge=1, le=MAX_N)
    # Every number a client sends is range-checked here, at the edge: an out-of-range one
    # (top_k 2**63, seed 2**70) used to overflow in torch inside the engine and kill it.
    # SamplingParams.validate repeats the checks for the offline LLM and the engine core.
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    # int64, what torch.Generator takes (vLLM's bound too).
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # refused as unsupported (ServingState.sampling_params)
    # vLLM's extras
    # -1 and 0 disable it; the bound above (the vocabulary) is checked where it is known,
    # ServingState.sampling_params.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_BOUND)
    ignore_eos: bool = False
    # Each id is looked for after every generated token: bounded in number, and below the
    # vocabulary (checked where it is known).
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Prefill/decode handoff, set by the router (vLLM's field name; see tandem/kvcache/connector/pd.py).
    # Internal (tandem/trust/fields.py): a worker takes it only on a peer-signed request.
    kv_transfer_params: dict[str, Any] | None = None
    # Salts the prompt's KV block hashes so only requests with the same salt share cached
    # blocks (vLLM's field): tenants' prompts never hit each other's cache.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # tandem: false opts this request out of speculative decoding, where the server runs it.
    speculate: bool = True
    # vLLM's field: each streamed choice carries the ids of the tokens it covers (`token_ids`).
    # The router asks for them so that it can move a broken stream to another worker.
    return_token_ids: bool = False
    # Structured outputs (tandem/server/structured_output.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=1024)
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        vocab_size: int | None = None) -> SamplingParams:
        """The engine's parameters; `vocab_size`, where given, also bounds top_k and
        stop_token_ids (ValueError, its message starting with the field's name)."""
        params = SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k < 0 else self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            speculate=self.speculate,
        )
        params.validate(vocab_size=vocab_size)
        return params


# Template variables a request may not set through `chat_template_kwargs`: the renderer's own
# arguments (what the request's other fields set) and options tandem does not take.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "tokenizer_kwargs", "padding", "truncation",
    "max_length", "return_tensors", "return_assistant_tokens_mask", "sanitize_control_tokens",
    "tools_ts_str",  # Kimi K2.5's tools in TypeScript: written from `tools` (server/typescript_tools.py)
})
_TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_TEMPLATE_KWARGS = 32


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` (vLLM's field: `enable_thinking` for Qwen3, `thinking` for Kimi and
    DeepSeek-V3.1): template variables, named as identifiers, none of the renderer's own."""
    if value is None:
        return None
    if len(value) > _MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {_MAX_TEMPLATE_KWARGS} chat_template_kwargs")
    for name in value:
        if not _TEMPLATE_KWARG_NAME.fullmatch(name):
            raise ValueError(f"chat_template_kwargs name {name[:80]!r} is not an identifier")
        if name in _RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs cannot set {name!r}: use the request's own field")
    return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_BOUND)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_BOUND)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        top = self.top_logprobs or 0
        if not 0 <= top <= _MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {top}")
        return top


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_BOUND)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def num_logprobs(self) -> int | None:
        if self.logprobs is None:
            return None
        if not 0 <= self.logprobs <= 5:
            raise ValueError(f"logprobs must be in [0, 5] for completions, got {self.logprobs}")
        return self.logprobs


class TokenizeRequest(OpenAIModel):
    """A prompt, or chat fields (with tools) rendered exactly as a chat request would be."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]
