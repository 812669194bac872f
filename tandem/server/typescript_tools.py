"""Tool declarations written as TypeScript types, the form Kimi K2.5 was trained to read.

Kimi K2.5's chat template declares tools in a `tool_declare` turn: as compact JSON, or, when
the caller passes `tools_ts_str`, as a `namespace functions { ... }` of TypeScript function
types, which is what Moonshot's own tokenizer code computes for every request with tools (so
what vLLM renders with that code trusted). tandem runs no code from a model directory, so the
rendering is written here; `chat_prompt.render_chat_prompt` passes it to any template that
reads `tools_ts_str`.

The form, per function: its `$defs` as `interface NAME {...}` lines, its description as `//`
lines, then `type NAME = (_: {...}) => any;`. Inside an object, required fields come first,
then optional ones (`name?:`), each group by name; each field is preceded by its
description, its constraints (`// maxLength: 8, minLength: 1`: string lengths and pattern,
number bounds, array sizes, sorted by key) and its default (`// Default: ...`). integer is
written `number`, an enum as its literals joined by `|`, anyOf and type lists as unions,
`additionalProperties` as an index signature (`[k: string]: any | never | T`), a `$ref` by
its definition's name (`#`, the root, makes the parameters an `interface parameters`).

A schema this form cannot write (a `$ref` to a missing definition, an enum of another type
than declared, a node that is not a schema) raises `UnrenderableSchema`; the caller then
leaves `tools_ts_str` out and the template declares the tools as JSON, as it would for any
caller that does not compute the TypeScript form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

INDENT = "  "
_MAX_DEPTH = 64  # nesting a tool schema may reach; deeper is refused, not recursed into
_CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                "integer": ("maximum", "minimum"), "array": ("minItems", "maxItems")}
_UNION_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
                "null": "null", "object": "{}", "array": "Array<any>"}
_ENUM_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "number": (int, float), "integer": (int,),
                                            "boolean": (bool,)}


class UnrenderableSchema(ValueError):
    """A tool schema the TypeScript form cannot write."""


def tools_as_typescript(tools: list[Mapping[str, Any]]) -> str:
    """The `# Tools` section for OpenAI-form tools (`{"type": "function", "function": ...}`);
    "" when none is a function."""
    functions = [_function(tool["function"]) for tool in tools
                 if tool.get("type") == "function" and tool.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


class _Definitions:
    """A function's `$defs`, in the order met, and whether `#` (the root) was referenced."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.root_referenced = False

    def add(self, defs: Any) -> None:
        if defs:
            if not isinstance(defs, Mapping):
                raise UnrenderableSchema("$defs must be an object")
            self.schemas.update(defs)

    def name(self, ref: Any) -> str:
        if ref == "#":
            self.root_referenced = True
            return "parameters"
        if isinstance(ref, str) and ref.startswith("#/$defs/") and ref.split("/")[-1] in self.schemas:
            return ref.split("/")[-1]
        raise UnrenderableSchema(f"a $ref this form cannot resolve: {str(ref)[:80]}")


def _function(function: Mapping[str, Any]) -> str:
    definitions = _Definitions()
    parameters = function.get("parameters") or {}
    if not isinstance(parameters, Mapping):
        raise UnrenderableSchema("parameters must be an object")
    fields = _object_fields(parameters, definitions, INDENT, sort=True, depth=0)  # registers $defs
    name = function.get("name", "function")
    parts = []
    if definitions.root_referenced:  # the fields as declared, without an index signature
        unsorted = _object_fields({k: v for k, v in parameters.items() if k != "additionalProperties"},
                                  definitions, INDENT, sort=False, depth=0)
        parts.append("interface parameters {" + (f"\n{_FIELD_DELIMITER.join(unsorted)}\n" if unsorted else "") + "}")
    for def_name, schema in list(definitions.schemas.items()):
        described = _comment(schema.get("description", ""), "") + "\n" if isinstance(schema, Mapping) and schema.get("description") else ""
        parts.append(f"{described}interface {def_name} {_type(schema, definitions, '', 1)}")
    description = function.get("description")
    if description:
        parts.append(_comment(_text(description), ""))
    signature = "parameters" if definitions.root_referenced else _wrap(fields, "")
    parts.append(f"type {name} = (_: {signature}) => any;")
    return "\n".join(parts)


_FIELD_DELIMITER = ",\n"


def _wrap(fields: list[str], indent: str) -> str:
    return "{\n" + _FIELD_DELIMITER.join(fields) + "\n" + indent + "}" if fields else "{}"


def _object_fields(schema: Mapping[str, Any], definitions: _Definitions, indent: str, sort: bool,
                   depth: int) -> list[str]:
    """An object's field lines at `indent` (its index signature last)."""
    definitions.add(schema.get("$defs"))
    properties = schema.get("properties") or {}
    if not isinstance(properties, Mapping):
        raise UnrenderableSchema("properties must be an object")
    required = schema.get("required") or []
    if not isinstance(required, list):
        raise UnrenderableSchema("required must be a list")
    names = list(properties)
    if sort:
        names = sorted(n for n in names if n in required) + sorted(n for n in names if n not in required)
    lines = [_field(name, properties[name], name not in required, definitions, indent, depth) for name in names]
    extra = schema.get("additionalProperties")
    if extra is not None:
        if extra is True:
            written = "any"
        elif extra is False:
            written = "never"
        elif isinstance(extra, Mapping):
            written = _type(extra, definitions, indent, depth + 1)
        else:
            raise UnrenderableSchema("additionalProperties must be a boolean or a schema")
        lines.append(f"{indent}[k: string]: {written}")
    return lines


def _field(name: str, schema: Any, optional: bool, definitions: _Definitions, indent: str, depth: int) -> str:
    written = _type(schema, definitions, indent, depth + 1)
    lines = _notes(schema, indent)
    default = schema.get("default") if isinstance(schema, Mapping) else None
    if default is not None:
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        lines += f"{indent}// Default: {shown}\n"
    return f"{lines}{indent}{name}{'?' if optional else ''}: {written}"


def _notes(schema: Any, indent: str) -> str:
    """A type's description and constraints as `//` lines, each ending in a newline."""
    if not isinstance(schema, Mapping):
        return ""
    lines = []
    if schema.get("description"):
        lines.append(_comment(_text(schema["description"]), indent))
    kind = _kind(schema)
    keys = _CONSTRAINTS.get(schema["type"], ()) if kind in ("scalar", "array") else ()
    constraints = sorted((k, schema[k]) for k in keys if k in schema)
    if constraints:
        lines.append(f"{indent}// " + ", ".join(f"{k}: {v}" for k, v in constraints))
    return "".join(line + "\n" for line in lines)


def _kind(schema: Any) -> str:
    if isinstance(schema, bool):
        return "bool"
    if not isinstance(schema, Mapping):
        raise UnrenderableSchema("a schema must be an object or a boolean")
    if "$ref" in schema:
        return "ref"
    if "anyOf" in schema:
        return "anyOf"
    if "enum" in schema:
        return "enum"
    if "type" in schema:
        typ = schema["type"]
        if isinstance(typ, list):
            return "union"
        return {"object": "object", "array": "array"}.get(typ, "scalar") if isinstance(typ, str) else _bad_type()
    if not schema:
        return "any"
    raise UnrenderableSchema("a schema without a type, enum, anyOf or $ref")


def _bad_type() -> str:
    raise UnrenderableSchema("type must be a string or a list of strings")


def _type(schema: Any, definitions: _Definitions, indent: str, depth: int) -> str:
    """The TypeScript type of a schema written at `indent`."""
    if depth > _MAX_DEPTH:
        raise UnrenderableSchema(f"a schema nested deeper than {_MAX_DEPTH} levels")
    kind = _kind(schema)
    if kind == "bool":
        return "any" if schema else "null"
    if kind == "any":
        return "any"
    if kind == "ref":
        return definitions.name(schema["$ref"])
    if kind == "anyOf":
        options = schema["anyOf"]
        if not isinstance(options, list):
            raise UnrenderableSchema("anyOf must be a list")
        return " | ".join(_type(option, definitions, indent, depth + 1) for option in options)
    if kind == "enum":
        return _enum(schema)
    if kind == "union":
        try:
            return " | ".join(_UNION_NAMES[t] for t in schema["type"])
        except (KeyError, TypeError) as exc:
            raise UnrenderableSchema("a type list of unknown types") from exc
    if kind == "object":
        return _wrap(_object_fields(schema, definitions, indent + INDENT, sort=True, depth=depth), indent)
    if kind == "array":
        items = schema.get("items")
        item = items if items else {"type": "any"}
        inner = _notes(item, indent + INDENT)
        written = _type(item, definitions, indent + INDENT if inner else indent, depth + 1)
        return f"Array<\n{inner}{indent}{INDENT}{written}\n{indent}>" if inner else f"Array<{written}>"
    return "number" if schema["type"] == "integer" else schema["type"]


def _enum(schema: Mapping[str, Any]) -> str:
    values = schema["enum"]
    if not isinstance(values, list):
        raise UnrenderableSchema("enum must be a list")
    declared = schema.get("type")
    if isinstance(declared, list):  # one type, or one and null
        if len(declared) == 2 and "null" in declared:
            declared = declared[1] if declared[0] == "null" else declared[0]
        elif len(declared) == 1:
            declared = declared[0]
        else:
            raise UnrenderableSchema(f"an enum of type {declared}")
    allowed = _ENUM_TYPES.get(declared) if isinstance(declared, str) else None
    for value in values:  # (a bool passes as a number: Python's bool is an int)
        if allowed and value is not None and not isinstance(value, allowed):
            raise UnrenderableSchema(f"enum value {value!r} is not a {declared}")
    return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in values)


def _comment(text: str, indent: str) -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise UnrenderableSchema("a description must be a string")
    return value
