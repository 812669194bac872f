"""Requests shaped as Claude Code (npm @anthropic-ai/claude-code) sends them to /v1/messages.

What it sends on a turn: `?beta=true`, the `anthropic-beta` list, its session header and a
key in `x-api-key`; a body with `metadata.user_id` (a JSON string holding the session), a
system of text blocks whose first is the `x-anthropic-billing-header: ...` line (it changes
between versions and requests) and whose last carries a cache breakpoint, 12 tools with JSON
schemas, `max_tokens: 32000`, adaptive thinking, `context_management`, `output_config`,
`tool_choice` and `temperature`. Shortened here (the real system prompt is ~7k characters).
"""

from __future__ import annotations

import json
from typing import Any

BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
         "fine-grained-tool-streaming-2025-05-14,oauth-2025-04-20,prompt-caching-scope-2026-01-05,"
         "effort-2025-11-24")
SESSION = "0d6b7bde-5a8e-4b0e-9d49-3f2b2c1e7a10"


def _schema(**properties: str) -> dict[str, Any]:
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {name: {"type": kind, "description": f"The {name}"} for name, kind in properties.items()},
        "required": list(properties)[:1],
        "additionalProperties": False,
    }


TOOLS: list[dict[str, Any]] = [
    {"name": "Task", "description": "Launch a new agent to handle a complex task.",
     "input_schema": _schema(description="string", prompt="string", subagent_type="string")},
    {"name": "Bash", "description": "Executes a given bash command in a persistent shell session.",
     "input_schema": _schema(command="string", timeout="number", description="string")},
    {"name": "Glob", "description": "Fast file pattern matching tool.",
     "input_schema": _schema(pattern="string", path="string")},
    {"name": "Grep", "description": "A powerful search tool built on ripgrep.",
     "input_schema": _schema(pattern="string", path="string", glob="string")},
    {"name": "ExitPlanMode", "description": "Prompts the user to exit plan mode.",
     "input_schema": _schema(plan="string")},
    {"name": "Read", "description": "Reads a file from the local filesystem.",
     "input_schema": _schema(file_path="string", offset="number", limit="number")},
    {"name": "Edit", "description": "Performs exact string replacements in files.",
     "input_schema": _schema(file_path="string", old_string="string", new_string="string")},
    {"name": "Write", "description": "Writes a file to the local filesystem.",
     "input_schema": _schema(file_path="string", content="string")},
    {"name": "NotebookEdit", "description": "Replaces the contents of a Jupyter notebook cell.",
     "input_schema": _schema(notebook_path="string", new_source="string")},
    {"name": "WebFetch", "description": "Fetches content from a URL.",
     "input_schema": _schema(url="string", prompt="string")},
    {"name": "TodoWrite", "description": "Create and manage a structured task list.",
     "input_schema": {"type": "object", "properties": {"todos": {"type": "array", "items": {
         "type": "object", "properties": {"content": {"type": "string"}, "status": {"type": "string"}}}}},
                      "required": ["todos"]}},
    {"name": "WebSearch", "description": "Search the web.",
     "input_schema": _schema(query="string")},
]


def billing_header(version: str = "2.1.3.a41", nonce: str = "5f1c2") -> dict[str, Any]:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; "
                                    f"cc_entrypoint=cli; cch={nonce};"}


def system(text: str = "You are Claude Code, Anthropic's official CLI for Claude.",
           header: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [
        header or billing_header(),
        {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}},
    ]


def body(messages: list[dict[str, Any]], model: str = "claude-sonnet-4-5", **changes: Any) -> dict[str, Any]:
    """A Claude Code turn's body around `messages`; `changes` replace or add fields."""
    out: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "system": system(),
        "tools": TOOLS,
        "metadata": {"user_id": json.dumps({"device_id": "4f" * 32, "account_uuid": "",
                                            "session_id": SESSION})},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "tool_choice": {"type": "auto"},
        "temperature": 1,
        "stream": True,
    }
    out.update(changes)
    return out


def headers(key: str = "sk-ant-unused") -> dict[str, str]:
    return {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": BETAS,
        "x-api-key": key,
        "X-Claude-Code-Session-Id": SESSION,
        "x-app": "cli",
        "user-agent": "claude-cli/2.1.3 (external, cli)",
    }
