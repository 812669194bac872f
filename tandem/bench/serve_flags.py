"""`tandem bench serve`'s flags: targets, workload, load, launched servers and output, one
table each, in --help order; and the names the flags take (policy targets, KV tiers).

Kept apart from the bench itself so that the command table imports flags, not the bench's
machinery, and so each table sits beside the vocabulary it offers.
"""

from __future__ import annotations

from tandem.bench.load_client import ENDPOINTS
from tandem.bench.serve_workloads import WORKLOAD_NAMES
from tandem.flags.table import Flag, FlagTable

DEFAULT_MODEL = (
    "smollm2-135m"  # the alias tandem.loader.resolve knows (kept here: no loader import)
)
DEFAULT_KV = "2GiB"

POLICY_TARGETS = {
    # target name: (router policy, send x-session-affinity)
    "round_robin": ("round_robin", False),
    "least_tokens": ("least_tokens", False),
    "session": ("session", True),
    "kv_aware": ("kv_aware", False),
    "kv_aware+header": ("kv_aware", True),
}


KV_TIERS = ("cpu", "disk", "cluster")


TARGET_FLAGS = FlagTable("targets", (
    Flag(
        "--url", default=[], metavar="[NAME=]URL", action="append",
        help="an OpenAI-compatible server already running, e.g. "
        "vllm=http://127.0.0.1:8000 (repeatable)",
    ),
    Flag(
        "--launch", default=[], metavar="ENGINE", action="append",
        help="start and measure a server: tandem (one `tandem serve`), routed (router + 1 "
        "worker), colocated (router + 2 workers), pd (router + 1 prefill + 1 decode worker), "
        "vllm (repeatable or comma-separated); clusters split the cores among their workers",
    ),
    Flag(
        "--policies", default=[], metavar="POLICY", action="append",
        help="compare router policies, each on its own `tandem up --workers N` cluster: "
        f"{', '.join(POLICY_TARGETS)} (session and kv_aware+header send x-session-affinity; "
        "repeatable or comma-separated)",
    ),
    Flag(
        "--policy-workers", default=3, type=int, metavar="N",
        help="colocated workers behind the router of each --policies target (default: 3)",
    ),
    Flag(
        "--kv-tier-sets", default="off", metavar="SETS",
        help="run each --policies target once per KV tier set: off, cpu, cpu+disk, "
        "cpu+disk+cluster (the cluster store is a redis-server `tandem up` starts), "
        "comma-separated; a set may add @DTYPE (the chunks' --kv-tier-dtype: bfloat16, int8, "
        "int4) and :SIZE (its own CPU tier), e.g. cpu:240MiB,cpu@int8:120MiB (default: off)",
    ),
    Flag(
        "--kv-transfer-dtypes", default="auto", metavar="LIST",
        help="run the --launch pd target once per PD handoff codec (its workers' "
        "--kv-transfer-dtype): auto (the cache's own bytes), bfloat16, int8, int4, "
        "comma-separated; these pd clusters hand off over tcp (a shared-memory copy is "
        "always raw), and each one's report line says the handoff's bytes a token and time a "
        "pull (default: auto)",
    ),
    Flag(
        "--kv-tier-cpu-bytes", default="2GiB", metavar="SIZE",
        help="CPU-memory tier per worker in tier sets with cpu (default: 2GiB)",
    ),
    Flag(
        "--kv-store-memory", metavar="SIZE",
        help="the cluster tier's redis-server maxmemory in tier sets with cluster "
        "(default: tandem up's, 2GiB)",
    ),
    Flag(
        "--kv-store-admit-after", type=int, metavar="N",
        help="sightings before a chunk enters the disk and cluster tiers (default: the engine's, 2)",
    ),
    Flag(
        "--model", default=DEFAULT_MODEL,
        help=f"model the launched servers load (default: {DEFAULT_MODEL})",
    ),
    Flag(
        "--served-model-name", metavar="NAME",
        help="model name sent in requests (default: the first of GET /v1/models)",
    ),
    Flag("--api-key", help="sent as Authorization: Bearer KEY"),
))
WORKLOAD_FLAGS = FlagTable("workload", (
    Flag(
        "--workload", default="agentic", choices=WORKLOAD_NAMES,
        help="request set (default: agentic)",
    ),
    Flag(
        "--num-requests", default=64, type=int,
        help="fixed / random: number of requests (default: 64)",
    ),
    Flag("--input-len", default=512, type=int, help="fixed / random: prompt tokens (default: 512)"),
    Flag("--output-len", type=int, help="output tokens per request (default: 128; agentic: 32)"),
    Flag(
        "--range-ratio", default=0.5, type=float,
        help="random: lengths uniform in [(1-r)*len, (1+r)*len] (default: 0.5)",
    ),
    Flag("--sessions", default=16, type=int, help="agentic: sessions (default: 16)"),
    Flag("--turns-min", default=5, type=int, help="agentic: fewest turns (default: 5)"),
    Flag("--turns-max", default=20, type=int, help="agentic: most turns (default: 20)"),
    Flag(
        "--prefix-len", default=2000, type=int,
        help="agentic: shared system + tools prefix tokens (default: 2000)",
    ),
    Flag(
        "--user-len-min", default=100, type=int,
        help="agentic: fewest new tokens a turn (default: 100)",
    ),
    Flag(
        "--user-len-max", default=500, type=int,
        help="agentic: most new tokens a turn (default: 500)",
    ),
    Flag(
        "--max-context", type=int,
        help="agentic: a session stops before its context passes this many "
        "tokens (default: --max-model-len, else the model's, else 8192)",
    ),
    Flag(
        "--tokenizer", metavar="PATH",
        help="HF directory or tokenizer.json sizing prompts exactly (default: "
        "the launched model's; else ~1 token per word)",
    ),
    Flag("--workload-seed", default=0, type=int, help="seed of the request set (default: 0)"),
))
LOAD_FLAGS = FlagTable("load", (
    Flag(
        "--concurrency", type=int,
        help="closed loop: sessions in flight (default: 4 unless --request-rate)",
    ),
    Flag("--request-rate", type=float, help="open loop: Poisson session arrivals per second"),
    Flag("--max-concurrency", type=int, help="open loop: cap on sessions in flight"),
    Flag(
        "--session-header", switch=True,
        help="send x-session-affinity: <session id> with every request",
    ),
    Flag(
        "--endpoint", default="auto", choices=ENDPOINTS,
        help="auto: /v1/completions for fixed / random, /v1/chat/completions for agentic",
    ),
    Flag(
        "--protocol", default="chat", metavar="LIST",
        help="wire protocols of conversation turns, comma-separated: chat (/v1/chat/completions), "
        "messages (Anthropic /v1/messages), responses (OpenAI /v1/responses); each target runs "
        "once per protocol (a launched one afresh) and the report holds each to chat's figures "
        "(default: chat)",
    ),
    Flag(
        "--interleave-protocols", switch=True,
        help="with several --protocol: one run per target (a launched one once) in which every "
        "session is sent once in each protocol, the copies side by side, so the protocols are "
        "compared under the same load at the same moments instead of in runs minutes apart",
    ),
    Flag(
        "--no-ignore-eos", switch=True,
        help="do not send ignore_eos (for servers that refuse it; outputs may be shorter)",
    ),
    Flag(
        "--warmup-requests", default=1, type=int,
        help="untimed short requests before the run (default: 1)",
    ),
    Flag(
        "--request-timeout", default=600.0, type=float,
        help="seconds before a request counts as an error (default: 600)",
    ),
    Flag("--seed", default=0, type=int, help="seed of the Poisson arrivals (default: 0)"),
))
LAUNCH_FLAGS = FlagTable("launched servers", (
    Flag(
        "--kv-cache-memory", default=DEFAULT_KV, metavar="SIZE",
        help=f"KV cache budget of each launched server (default: {DEFAULT_KV})",
    ),
    Flag("--max-num-seqs", default=128, type=int, help="most sequences per step (default: 128)"),
    Flag(
        "--max-num-batched-tokens", default=2048, type=int,
        help="token budget per step (default: 2048)",
    ),
    Flag("--max-model-len", type=int, help="context length of both servers"),
    Flag("--threads", type=int, help="torch threads of both servers (vLLM through OMP_NUM_THREADS)"),
    Flag(
        "--vllm-python", metavar="PATH",
        help="Python of a venv with vllm (e.g. /opt/venvs/vllm/bin/python)",
    ),
    Flag(
        "--vllm-no-iomp-preload", switch=True,
        help="do not LD_PRELOAD the venv's libiomp5.so into vLLM",
    ),
    Flag(
        "--tandem-args", default="", metavar="ARGS",
        help="extra engine flags for `tandem serve`, and for every worker of a cluster target "
             "(`tandem up` passes them on), one quoted string",
    ),
    Flag(
        "--vllm-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
        help="vLLM's dtype; auto: the dtype tandem's default mode runs in on this CPU (bfloat16 where "
             "the CPU multiplies it natively), so a launched tandem without flags meets vLLM in its "
             "own best mode (default: auto)",
    ),
    Flag(
        "--vllm-args", default="", metavar="ARGS",
        help="extra flags for vLLM's OpenAI server, one quoted string",
    ),
    Flag(
        "--server-timeout", default=600.0, type=float,
        help="seconds a launched server may take to answer /health (default: 600)",
    ),
))
OUTPUT_FLAGS = FlagTable(None, (
    Flag(
        "--output-dir", default="bench-results",
        help="results go into OUTPUT_DIR/serve-<timestamp>/ (default: bench-results)",
    ),
))

SERVE_BENCH_TABLES = (TARGET_FLAGS, WORKLOAD_FLAGS, LOAD_FLAGS, LAUNCH_FLAGS, OUTPUT_FLAGS)
