"""A request's structured-output fields, as the one constraint the engine takes.

Clients ask for constrained output in several dialects: OpenAI's `response_format`
(`json_object`, `json_schema` with `strict`), tandem's `response_format` extensions (`regex`,
`grammar` in Lark or EBNF), vLLM's `structured_outputs` and its older `guided_*` fields. All
become one `GuidedDecoding`, checked here, where a schema that cannot be compiled is a 400
naming the problem before anything is queued (tandem/structured/grammar.py compiles it).

`response_format: json_schema` with `strict: false` is still enforced: a client that asks for
a schema gets output that matches it (OpenAI enforces only strict schemas; enforcing both is
what vLLM and SGLang do).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from tandem.edge.errors import bad_request
from tandem.edge.openai_protocol import SamplingFields
from tandem.server.chat_prompt import tool_choice_name
from tandem.server.tool_parsers.grammar import tool_call_grammar
from tandem.structured.grammar import GrammarError, grammar_text
from tandem.types import GuidedDecoding


def requested_constraint(body: SamplingFields) -> GuidedDecoding | None:
    """The request's constraint, validated; None for free output. A 400 naming the field
    for two constraints at once or one that does not compile."""
    found: list[tuple[str, GuidedDecoding]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        found.append(("response_format", _from_response_format(fmt)))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    for name, guided in (("guided_json", _json_field(body.guided_json, "guided_json")),
                         ("guided_regex", None if body.guided_regex is None else GuidedDecoding(regex=body.guided_regex)),
                         ("guided_choice", None if body.guided_choice is None
                          else GuidedDecoding(choice=tuple(body.guided_choice))),
                         ("guided_grammar", None if body.guided_grammar is None
                          else GuidedDecoding(grammar=body.guided_grammar, grammar_syntax=_syntax(body.guided_grammar)))):
        if guided is not None:
            found.append((name, guided))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"at most one output constraint per request; got {', '.join(n for n, _ in found)}",
                          found[1][0], "invalid_value")
    field, guided = found[0]
    return checked(guided, field)


def tool_constraint(state: Any, body: Any) -> GuidedDecoding | None:
    """The grammar a chat request's tool calls are generated under, or None (free output):
    `tool_choice` "required" (calls only), a named function (one call of it), or "auto" with a
    tool declared `strict: true` (text, or calls that validate). tool_parsers/grammar.py."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools or choice == "none":
        return None
    named = tool_choice_name(choice)
    strict = any(tool.function.strict for tool in tools)
    if choice in (None, "auto") and not strict:
        return None
    schemas = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in tools}
    if named is not None:
        if named not in schemas:
            return None  # rendering the prompt refuses the undeclared name with a 400
        schemas = {named: schemas[named]}
    required = choice not in (None, "auto")
    lark = tool_call_grammar(state.tool_parser, schemas, state.tokenizer.added_tokens_encoder, required=required,
                             parallel=named is None and body.parallel_tool_calls is not False)
    if lark is None:
        return None
    return checked(GuidedDecoding(grammar=lark), "tools")


def after_reasoning(state: Any, guided: GuidedDecoding | None, prompt: str) -> GuidedDecoding | None:
    """A chat constraint starts after the reasoning when the prompt leaves a reasoning block
    open (the model thinks freely first, then answers under the constraint)."""
    parser = state.reasoning_parser
    if guided is None or parser is None:
        return guided
    marker = parser.constraint_starts_after(prompt)
    return guided if marker is None else checked(replace(guided, starts_after=marker), "response_format")


def checked(guided: GuidedDecoding, field: str) -> GuidedDecoding:
    """`guided` once it compiles; otherwise a 400 naming `field` and the problem."""
    try:
        grammar_text(guided)
    except GrammarError as exc:
        raise bad_request(f"{field}: {exc}", field, "invalid_grammar") from None
    return guided


def _from_response_format(fmt: Any) -> GuidedDecoding:
    if fmt.type == "json_object":
        return GuidedDecoding(json_object=True)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format",
                              "invalid_value")
        return GuidedDecoding(json=json.dumps(fmt.json_schema.schema_))
    if fmt.type == "regex":
        if not fmt.regex:
            raise bad_request("response_format regex needs a non-empty `regex`", "response_format", "invalid_value")
        return GuidedDecoding(regex=fmt.regex)
    if not fmt.grammar:
        raise bad_request("response_format grammar needs a non-empty `grammar`", "response_format", "invalid_value")
    return GuidedDecoding(grammar=fmt.grammar, grammar_syntax=fmt.syntax)


def _from_structured_outputs(value: Any) -> GuidedDecoding:
    kinds = []
    if value.json_ is not None:
        kinds.append(_json_field(value.json_, "structured_outputs"))
    if value.json_object:
        kinds.append(GuidedDecoding(json_object=True))
    if value.regex is not None:
        kinds.append(GuidedDecoding(regex=value.regex))
    if value.choice is not None:
        kinds.append(GuidedDecoding(choice=tuple(value.choice)))
    if value.grammar is not None:
        kinds.append(GuidedDecoding(grammar=value.grammar, grammar_syntax=_syntax(value.grammar)))
    if len(kinds) != 1:
        raise bad_request("structured_outputs takes exactly one of json, json_object, regex, choice or grammar",
                          "structured_outputs", "invalid_value")
    return kinds[0]


def _json_field(value: Any, field: str) -> GuidedDecoding | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"{field} must be a JSON schema (an object, or its JSON text)", field,
                              "invalid_value") from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"{field} must be a JSON schema object", field, "invalid_value")
    return GuidedDecoding(json=json.dumps(value))


def _syntax(grammar: str) -> str:
    """vLLM's `grammar` field takes GBNF or Lark alike: GBNF rules are written `name ::= ...`."""
    return "ebnf" if "::=" in grammar else "lark"

