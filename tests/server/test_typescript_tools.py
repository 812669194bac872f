"""Tools as TypeScript (Kimi K2.5's `tools_ts_str`): the expected strings are written here by
hand from the form the module docstring describes, not produced by the code under test."""

from __future__ import annotations

import pytest

from tandem.server.typescript_tools import UnrenderableSchema, tools_as_typescript

EDIT = {"type": "function", "function": {
    "name": "edit", "description": "Edit a file.\n\nReplaces text.",
    "parameters": {"type": "object", "required": ["path", "edits"], "properties": {
        "path": {"type": "string", "description": "File to edit", "minLength": 1, "maxLength": 4096},
        "edits": {"type": "array", "minItems": 1, "items": {
            "type": "object", "description": "One replacement",
            "properties": {"old": {"type": "string"}, "new": {"type": "string"}}, "required": ["old", "new"]}},
        "mode": {"enum": ["replace", "append"], "default": "replace"},
        "count": {"type": "integer", "minimum": 0, "default": 1},
        "dry_run": {"type": ["boolean", "null"]},
        "target": {"anyOf": [{"type": "string"}, {"type": "number"}]},
        "meta": {"type": "object", "additionalProperties": {"type": "string"}},
        "tags": {"type": "array", "items": {"type": "string"}},
    }}}}

EDIT_TS = """// Edit a file.

// Replaces text.
type edit = (_: {
  // minItems: 1
  edits: Array<
    // One replacement
    {
      new: string,
      old: string
    }
  >,
  // File to edit
  // maxLength: 4096, minLength: 1
  path: string,
  // minimum: 0
  // Default: 1
  count?: number,
  dry_run?: boolean | null,
  meta?: {
    [k: string]: string
  },
  // Default: "replace"
  mode?: "replace" | "append",
  tags?: Array<string>,
  target?: string | number
}) => any;"""

TREE = {"type": "function", "function": {"name": "plant", "parameters": {
    "type": "object",
    "$defs": {"Leaf": {"type": "object", "description": "A leaf.", "properties": {"size": {"type": "number"}}}},
    "properties": {"leaf": {"$ref": "#/$defs/Leaf", "description": "The leaf to plant"}, "child": {"$ref": "#"}},
    "required": ["leaf"]}}}

TREE_TS = """interface parameters {
  // The leaf to plant
  leaf: Leaf,
  child?: parameters
}
// A leaf.
interface Leaf {
  size?: number
}
type plant = (_: parameters) => any;"""


def _section(*functions: str) -> str:
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def test_every_kind_of_field_is_written_as_kimi_reads_it() -> None:
    assert tools_as_typescript([EDIT]) == _section(EDIT_TS)


def test_definitions_and_a_reference_to_the_root_become_interfaces() -> None:
    assert tools_as_typescript([TREE, EDIT]) == _section(TREE_TS, EDIT_TS)


def test_no_parameters_no_function_tools_and_boolean_schemas() -> None:
    bare = {"type": "function", "function": {"name": "now"}}
    loose = {"type": "function", "function": {"name": "log", "parameters": {
        "type": "object", "properties": {"anything": True, "nothing": False, "free": {}},
        "additionalProperties": False}}}
    assert tools_as_typescript([bare, {"type": "custom", "custom": {"name": "x"}}]) == _section(
        "type now = (_: {}) => any;")
    assert tools_as_typescript([loose]) == _section(
        "type log = (_: {\n  anything?: any,\n  free?: any,\n  nothing?: null,\n  [k: string]: never\n}) => any;")
    assert tools_as_typescript([{"type": "custom", "custom": {"name": "x"}}]) == ""


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}},
    {"type": "object", "properties": {"a": {"type": "integer", "enum": ["one"]}}},
    {"type": "object", "properties": {"a": {"type": ["string", "date"]}}},
    {"type": "object", "properties": {"a": {"description": "no type"}}},
    {"type": "object", "properties": {"a": {"type": "string", "description": 7}}},
    {"type": "object", "properties": {"a": "string"}},
], ids=["missing-ref", "enum-type", "unknown-union", "untyped", "description-not-text", "not-a-schema"])
def test_what_the_form_cannot_write_is_refused_by_name(parameters: dict) -> None:
    with pytest.raises(UnrenderableSchema):
        tools_as_typescript([{"type": "function", "function": {"name": "f", "parameters": parameters}}])


def test_a_schema_nested_past_the_limit_is_refused_not_recursed_into() -> None:
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(UnrenderableSchema, match="deeper"):
        tools_as_typescript([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": schema}}}}])
