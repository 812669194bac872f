"""Tool-call parsing for the OpenAI server: model text <-> OpenAI `tool_calls`.

See `base` for the contract between the server and a parser (prompt rendering, forced calls,
streaming guarantees).
"""

from tandem.server.tool_parsers.base import (
    ParsedMessage,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamParser,
    new_call_id,
)
from tandem.server.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from tandem.server.tool_parsers.hermes import HermesToolParser
from tandem.server.tool_parsers.kimi_k2 import KimiK2ToolParser
from tandem.server.tool_parsers.llama3_json import Llama3JsonToolParser
from tandem.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from tandem.server.tool_parsers.registry import (
    DEFAULT_TOOL_PARSER,
    TOOL_PARSERS,
    detect_tool_parser,
    get_tool_parser,
    template_supports_tools,
)

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "TOOL_PARSERS",
    "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser",
    "HermesToolParser",
    "KimiK2ToolParser",
    "Llama3JsonToolParser",
    "ParsedMessage",
    "Qwen3CoderToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamParser",
    "detect_tool_parser",
    "get_tool_parser",
    "new_call_id",
    "template_supports_tools",
]
