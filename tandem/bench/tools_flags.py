"""`tandem bench tools`'s flags: targets, the validity cases, the cost and jump-forward parts,
launched servers (the serve bench's table, so both benches launch servers alike) and output.

Kept apart from the bench so the command table imports flags, not the bench's machinery.
"""

from __future__ import annotations

from tandem.bench.serve_flags import LAUNCH_FLAGS
from tandem.flags.table import Flag, FlagTable

DEFAULT_TOOLS_MODEL = "qwen2.5-coder-0.5b"  # an alias tandem.loader.resolve knows; Qwen2.5 calls tools
LAUNCHABLE = ("tandem", "vllm")

TARGET_FLAGS = FlagTable("targets", (
    Flag(
        "--url", default=[], metavar="[NAME=]URL", action="append",
        help="a server already running, benched instead of (or beside) a launched one, e.g. "
        "vllm=http://127.0.0.1:8000 (repeatable)",
    ),
    Flag(
        "--launch", default=[], metavar="ENGINE", action="append",
        help="start and measure a server: tandem, vllm (needs --vllm-python); repeatable or "
        "comma-separated (default: tandem when no --url is given)",
    ),
    Flag(
        "--model", default=DEFAULT_TOOLS_MODEL,
        help=f"model the launched servers load (default: {DEFAULT_TOOLS_MODEL})",
    ),
    Flag(
        "--served-model-name", metavar="NAME",
        help="model name sent in requests (default: the first of GET /v1/models)",
    ),
    Flag("--api-key", help="sent as Authorization: Bearer KEY (and given to launched servers)"),
))
CASE_FLAGS = FlagTable("tool-call validity", (
    Flag(
        "--num-cases", type=int, metavar="N",
        help="run the first N cases (the kinds stay interleaved; default: all 224)",
    ),
    Flag(
        "--modes", default="auto,required,strict", metavar="LIST",
        help='auto (tool_choice "auto"), required (tool_choice "required"), strict ("auto" with '
        'every function "strict": true), comma-separated (default: auto,required,strict)',
    ),
    Flag("--max-tokens", default=256, type=int, help="max_tokens of each case (default: 256)"),
    Flag("--concurrency", default=4, type=int, help="cases in flight (default: 4)"),
    Flag("--case-seed", default=0, type=int, help="seed of the generated cases (default: 0)"),
))
COST_FLAGS = FlagTable("cost of constraining", (
    Flag(
        "--skip-cost", switch=True,
        help="skip the response_format json_schema vs unconstrained throughput part",
    ),
    Flag(
        "--cost-concurrency", default="1,32", metavar="LIST",
        help="concurrencies to compare at, comma-separated (default: 1,32)",
    ),
    Flag(
        "--cost-requests", type=int, metavar="N",
        help="requests per concurrency and kind (default: the concurrency, at least 4)",
    ),
    Flag("--cost-max-tokens", default=192, type=int, help="max_tokens of each request (default: 192)"),
))
JUMP_FLAGS = FlagTable("jump-forward", (
    Flag(
        "--skip-jump-forward", switch=True,
        help="skip the tokens-per-step part (schemas with long fixed keys)",
    ),
    Flag("--jump-requests", default=12, type=int, help="requests of the part (default: 12)"),
    Flag("--jump-concurrency", default=4, type=int, help="requests in flight (default: 4)"),
    Flag("--jump-max-tokens", default=256, type=int, help="max_tokens of each request (default: 256)"),
))
OUTPUT_FLAGS = FlagTable("output", (
    Flag(
        "--report", metavar="PATH",
        help="the JSON report (default: OUTPUT_DIR/tools-<timestamp>/tools.json); the PNG goes beside it",
    ),
    Flag(
        "--output-dir", default="bench-results",
        help="launched servers' logs and the default report go into OUTPUT_DIR/tools-<timestamp>/ "
        "(default: bench-results)",
    ),
    Flag(
        "--request-timeout", default=600.0, type=float,
        help="seconds before a request counts as an error (default: 600)",
    ),
))

TOOLS_BENCH_TABLES = (TARGET_FLAGS, CASE_FLAGS, COST_FLAGS, JUMP_FLAGS, LAUNCH_FLAGS, OUTPUT_FLAGS)
