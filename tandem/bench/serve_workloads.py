"""Seeded request sets for `tandem bench serve`: text prompts sized in tokens.

The load client speaks HTTP, so a workload is text, not token ids. Lengths are measured with
the model's own tokenizer when one is given (``tokenizers.Tokenizer`` from a tokenizer.json;
imported lazily, no torch), else approximated as one token per word or punctuation mark. The
text is drawn from a fixed vocabulary, so it reads like plausible English, and every word is a
single token of the tokenizer where one is known: sizing is then exact, not an estimate.

Workloads (every request is one *turn* of a *session*; a session's turns run one after
another, sessions run concurrently):

- ``fixed``: N one-turn sessions of exactly ``input_len`` prompt tokens and ``output_len``
  output tokens.
- ``random``: like ``fixed`` with both lengths drawn uniformly from
  ``[(1 - r) * len, (1 + r) * len]`` (``range_ratio`` r).
- ``agentic``: S sessions that share one system message (instructions plus JSON tool schemas,
  about ``prefix_len`` tokens) and grow turn by turn. Each turn adds a user message of
  ``user_len_min``-``user_len_max`` tokens, is sent with the whole history (including the
  server's actual replies to the earlier turns) and asks for a short answer. The text after
  the shared prefix is distinct per session, so a prefix cache helps exactly where an agent's
  traffic lets it: the shared system prompt across sessions, the history within a session.
  A session stops adding turns before its context would pass ``max_context`` tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

WORKLOAD_NAMES = ("fixed", "random", "agentic")

# Chat-template tokens a message costs besides its content (role markers, newlines); used only
# to keep agentic sessions inside the context window, so an overestimate is the safe side.
MESSAGE_OVERHEAD_TOKENS = 8

_SEEDS = {"fixed": 11, "random": 22, "agentic": 33, "system": 44, "warmup": 55}

_WORDS = (
    "the a an and or but if then when while because so that this these those it its we you "
    "they he she one two three four five six seven eight nine ten first second next last new "
    "old same other each every all some many few more most less least own only just also "
    "very still already again now here there where how what which who why not no yes can "
    "will should would could must may might need want have has had do does did make made use "
    "used find found read write run build test check fix change add remove move copy open "
    "close start stop keep show list look see get set put take give call return send load "
    "save print parse match sort merge split join count update create delete rename search "
    "file files line lines code function class method value values type types name names "
    "path paths list item items key keys table row rows column field record data input output "
    "result results error errors warning message log logs test tests case cases step steps "
    "task plan idea point part end time day week state status mode option options flag flags "
    "server client request response query answer question user users team project module "
    "package version release branch commit change changes patch issue bug feature config "
    "setting settings cache memory disk network port host page block token tokens model batch "
    "queue worker job loop thread process system service method number size length limit "
    "order group level rate cost price score weight label note text word words string buffer "
    "after before under over into from with without about between through during until above "
    "below near far long short small large big high low fast slow early late good bad clear "
    "simple easy hard safe ready open empty full true false valid wrong right left main local "
    "remote public private current previous default final total average careful quick "
    "directory repository function argument parameter variable object array index schema "
    "format header body document report summary section chapter example sample reason"
)
VOCABULARY: tuple[str, ...] = tuple(dict.fromkeys(_WORDS.split()))

TOOL_NAMES = (
    "read_file",
    "write_file",
    "edit_file",
    "list_directory",
    "search_code",
    "run_shell",
    "run_tests",
    "git_diff",
    "git_commit",
    "http_get",
    "query_database",
    "create_ticket",
    "send_message",
    "get_weather",
    "calculate",
    "translate_text",
    "summarize_document",
    "schedule_meeting",
    "lookup_customer",
    "update_record",
    "fetch_metrics",
    "deploy_service",
    "open_browser",
    "take_screenshot",
)
PARAM_NAMES = (
    "path",
    "query",
    "content",
    "command",
    "timeout",
    "limit",
    "offset",
    "pattern",
    "url",
    "message",
    "recipient",
    "branch",
    "language",
    "format",
    "record_id",
    "fields",
    "start",
    "end",
    "city",
    "units",
    "expression",
    "service",
    "environment",
    "dry_run",
)
PARAM_TYPES = ("string", "string", "string", "integer", "boolean", "number")

_TURN_LEADS = (
    "Tool output from {tool}:",
    "Here is the result of {tool}:",
    "Next step. The {tool} call returned:",
    "Follow-up from the user:",
    "The test run finished. Log:",
    "Please continue. Context:",
)
_TOKEN_PATTERN = re.compile(r"\w+|[^\w\s]")


class Sizer(Protocol):
    """Counts tokens of a text; ``words`` are the vocabulary words that make up prompts."""

    exact: bool
    words: tuple[str, ...]

    def count(self, text: str) -> int: ...


class WordSizer:
    """No tokenizer at hand: a word or a punctuation mark counts as one token.

    Short English words are one token in the BPE vocabularies of common models, so this is
    close for prose and rougher for JSON; the server's usage counts are what the report uses.
    """

    exact = False

    def __init__(self) -> None:
        self.words = tuple(VOCABULARY)

    def count(self, text: str) -> int:
        return len(_TOKEN_PATTERN.findall(text))


class TokenizerSizer:
    """Counts with the model's tokenizer; keeps only the words that are one token after a space,
    so a prompt of n words (plus punctuation, also one token each) is n tokens."""

    exact = True

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"--tokenizer {path}: no tokenizer.json there")
        self.path = file
        self._tokenizer = Tokenizer.from_file(str(file))
        words = tuple(w for w in VOCABULARY if len(self._encode(" " + w)) == 1)
        if len(words) < 20:  # a tokenizer that splits plain English: fall back to all words
            words = tuple(VOCABULARY)
        self.words = words

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def count(self, text: str) -> int:
        return len(self._encode(text))


def make_sizer(tokenizer: str | Path | None) -> Sizer:
    return TokenizerSizer(tokenizer) if tokenizer else WordSizer()


def _pieces(rng: random.Random, words: tuple[str, ...]) -> Iterator[str]:
    """An endless stream of words and punctuation that reads like (dull) sentences."""
    while True:
        length = rng.randint(6, 16)
        for i in range(length):
            yield rng.choice(words)
            if 2 < i < length - 2 and rng.random() < 0.08:
                yield ","
        yield "."


def _render(lead: str, pieces: list[str]) -> str:
    body = "".join(p if p in ".," else " " + p for p in pieces)
    return lead + body if lead else body.lstrip()


def make_text(sizer: Sizer, rng: random.Random, num_tokens: int, lead: str = "") -> str:
    """Text of ``num_tokens`` tokens by ``sizer``: ``lead`` followed by vocabulary sentences.

    Pieces are added or dropped at the end until the count matches; each piece is one token
    (by construction for the tokenizer sizer), so this converges in a step or two. A lead that
    alone is longer than the target is dropped.
    """
    if num_tokens <= 0:
        return ""
    if lead and sizer.count(lead) >= num_tokens:
        lead = ""
    stream = _pieces(rng, sizer.words)
    pieces = [next(stream) for _ in range(num_tokens)]
    text = _render(lead, pieces)
    best = text
    for _ in range(32):
        count = sizer.count(text)
        if count == num_tokens:
            return text
        if count < num_tokens:
            best = text  # the longest text found that still fits
            pieces += [next(stream) for _ in range(num_tokens - count)]
        else:
            pieces = pieces[: max(1, len(pieces) - (count - num_tokens))]
            if len(pieces) == 1 and sizer.count(_render(lead, pieces)) > num_tokens:
                return best
        text = _render(lead, pieces)
    return best


@dataclass(frozen=True)
class WorkloadConfig:
    """Every knob of the three workloads (each uses its own subset)."""

    name: str = "agentic"
    seed: int = 0
    # fixed / random
    num_requests: int = 64
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.5
    # agentic
    num_sessions: int = 16
    turns_min: int = 5
    turns_max: int = 20
    prefix_len: int = 2000
    user_len_min: int = 100
    user_len_max: int = 500
    agentic_output_len: int = 32
    max_context: int = 8192

    def validate(self) -> None:
        if self.name not in WORKLOAD_NAMES:
            raise ValueError(
                f"unknown workload {self.name!r}; choose from {', '.join(WORKLOAD_NAMES)}"
            )
        positive = {
            "num_requests": self.num_requests,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "num_sessions": self.num_sessions,
            "turns_min": self.turns_min,
            "user_len_min": self.user_len_min,
            "agentic_output_len": self.agentic_output_len,
            "max_context": self.max_context,
        }
        bad = [k for k, v in positive.items() if v < 1]
        if bad:
            raise ValueError(f"workload settings must be >= 1: {', '.join(bad)}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.turns_max < self.turns_min:
            raise ValueError(f"turns_max {self.turns_max} < turns_min {self.turns_min}")
        if self.user_len_max < self.user_len_min:
            raise ValueError(f"user_len_max {self.user_len_max} < user_len_min {self.user_len_min}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")


@dataclass(frozen=True)
class Turn:
    """One request: the new user text (chat) or the whole prompt (completions)."""

    prompt: str
    prompt_len: int  # tokens of ``prompt`` by the sizer (template tokens not included)
    max_tokens: int


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    protocol: str | None = None  # its turns' wire protocol; None: the run's (TrafficConfig)
    cache_salt: str | None = None  # keeps its prefix cache apart (interleave_protocols)


@dataclass(frozen=True)
class ServeWorkload:
    """Sessions to run; ``system`` is the message every session starts with (or None)."""

    name: str
    sessions: tuple[Session, ...]
    system: str | None = None
    system_len: int = 0
    exact_sizing: bool = False
    description: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def chat_only(self) -> bool:
        """Multi-turn workloads need messages; one-turn prompts also fit /v1/completions."""
        return self.system is not None or any(len(s.turns) > 1 for s in self.sessions)

    def summary(self) -> dict[str, Any]:
        turns = [t for s in self.sessions for t in s.turns]
        lengths = [t.prompt_len for t in turns]
        return {
            "name": self.name,
            "description": self.description,
            "num_sessions": len(self.sessions),
            "num_requests": self.num_requests,
            "system_len": self.system_len,
            "new_prompt_tokens": sum(lengths),
            "prompt_len_min": min(lengths, default=0),
            "prompt_len_max": max(lengths, default=0),
            "max_tokens_total": sum(t.max_tokens for t in turns),
            "exact_sizing": self.exact_sizing,
            **self.meta,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _uniform_len(rng: random.Random, length: int, ratio: float) -> int:
    return rng.randint(max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio))))


def _one_turn_sessions(config: WorkloadConfig, sizer: Sizer) -> ServeWorkload:
    rng = random.Random(_SEEDS[config.name] * 1_000_003 + config.seed)
    ratio = config.range_ratio if config.name == "random" else 0.0
    sessions = []
    for i in range(config.num_requests):
        prompt_len = _uniform_len(rng, config.input_len, ratio)
        max_tokens = _uniform_len(rng, config.output_len, ratio)
        text = make_text(sizer, rng, prompt_len)
        turn = Turn(text, sizer.count(text), max_tokens)
        sessions.append(Session(f"{config.name}-{i:05d}", (turn,)))
    if ratio:
        description = (
            f"{config.num_requests} requests, input {config.input_len}, output "
            f"{config.output_len} tokens, each +-{ratio:.0%}"
        )
    else:
        description = (
            f"{config.num_requests} requests of {config.input_len} input and "
            f"{config.output_len} output tokens"
        )
    return ServeWorkload(
        config.name, tuple(sessions), exact_sizing=sizer.exact, description=description
    )


def _tool(rng: random.Random, sizer: Sizer, name: str) -> dict[str, Any]:
    params = rng.sample(PARAM_NAMES, rng.randint(1, 4))
    properties = {
        p: {
            "type": rng.choice(PARAM_TYPES),
            "description": make_text(sizer, rng, rng.randint(4, 10)),
        }
        for p in params
    }
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": make_text(sizer, rng, rng.randint(8, 24)),
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": params[: rng.randint(1, len(params))],
            },
        },
    }


def system_prompt(sizer: Sizer, prefix_len: int, seed: int = 0) -> tuple[str, list[str]]:
    """The shared system message (about ``prefix_len`` tokens) and the tool names it defines.

    About 60% of it is tool schemas as JSON, the rest instructions prose: what an agent
    framework puts in front of every request.
    """
    rng = random.Random(_SEEDS["system"] * 1_000_003 + seed)
    head = (
        "You are a careful software agent. You can call the tools listed below. To call a "
        "tool, answer with a JSON object holding its name and arguments.\n\n# Tools\n"
    )
    tools: list[dict[str, Any]] = []
    budget = int(prefix_len * 0.6)
    names = list(TOOL_NAMES)
    rng.shuffle(names)
    for index in range(10_000):
        name = names[index % len(names)] + ("" if index < len(names) else f"_{index // len(names)}")
        candidate = tools + [_tool(rng, sizer, name)]
        if sizer.count(head + json.dumps(candidate, indent=1)) > budget:
            break
        tools = candidate
    text = head + (json.dumps(tools, indent=1) if tools else "(none)") + "\n\n# Guidelines\n"
    text = make_text(sizer, rng, prefix_len, lead=text)
    return text, [t["function"]["name"] for t in tools]


def _agentic(config: WorkloadConfig, sizer: Sizer) -> ServeWorkload:
    system, tool_names = system_prompt(sizer, config.prefix_len, config.seed)
    system_len = sizer.count(system)
    num_tools = len(tool_names)
    tool_names = tool_names or list(TOOL_NAMES[:4])  # lead-ins still name a tool
    sessions = []
    capped = 0
    for s in range(config.num_sessions):
        # One generator per session: session s has the same turns whatever the session count.
        rng = random.Random((_SEEDS["agentic"] * 1_000_003 + config.seed) * 65_537 + s)
        session_id = f"session-{s:04d}"
        wanted = rng.randint(config.turns_min, config.turns_max)
        context = system_len + MESSAGE_OVERHEAD_TOKENS
        turns: list[Turn] = []
        for k in range(wanted):
            user_len = rng.randint(config.user_len_min, config.user_len_max)
            if k == 0:
                lead = f"Task {session_id}:"
            else:
                lead = rng.choice(_TURN_LEADS).format(tool=rng.choice(tool_names))
            text = make_text(sizer, rng, user_len, lead=lead)
            length = sizer.count(text)
            # this turn's prompt plus its own reply must fit the model's context
            need = length + 2 * MESSAGE_OVERHEAD_TOKENS + config.agentic_output_len
            if turns and context + need > config.max_context:
                capped += 1
                break
            turns.append(Turn(text, length, config.agentic_output_len))
            context += length + config.agentic_output_len + 2 * MESSAGE_OVERHEAD_TOKENS
        sessions.append(Session(session_id, tuple(turns)))
    description = (
        f"{config.num_sessions} sessions x {config.turns_min}-{config.turns_max} turns, "
        f"shared prefix {system_len} tokens ({num_tools} tools), "
        f"+{config.user_len_min}-{config.user_len_max} tokens a turn, "
        f"{config.agentic_output_len} output tokens"
    )
    if capped:
        description += f"; {capped} sessions cut at {config.max_context} context tokens"
    return ServeWorkload(
        "agentic",
        tuple(sessions),
        system=system,
        system_len=system_len,
        exact_sizing=sizer.exact,
        description=description,
        meta={"tools": num_tools, "sessions_capped": capped},
    )


def build_serve_workload(config: WorkloadConfig, sizer: Sizer | None = None) -> ServeWorkload:
    """The workload ``config`` names, deterministic in ``config.seed`` (and the tokenizer)."""
    config.validate()
    sizer = sizer or WordSizer()
    if config.name == "agentic":
        return _agentic(config, sizer)
    return _one_turn_sessions(config, sizer)


def interleave_protocols(workload: ServeWorkload, protocols: list[str]) -> ServeWorkload:
    """Every session once per protocol, the copies next to each other, for one run that
    compares the protocols under the same load at the same moments (a protocol's separate run
    sees the box's drift as a difference). Each protocol's copies carry a `cache_salt` of their
    own, so one protocol never reads a prefix another filled and each caches across its own
    sessions as a run of it alone would, while the prompts stay token for token the same (so
    are the greedy outputs). The order of the copies turns with each session, so no protocol is
    always the first of its group to reach the server."""
    sessions = tuple(
        dataclasses.replace(session, session_id=f"{session.session_id}-{protocol}", protocol=protocol,
                            cache_salt=f"bench-{protocol}")
        for n, session in enumerate(workload.sessions)
        for protocol in protocols[n % len(protocols):] + protocols[:n % len(protocols)]
    )
    return dataclasses.replace(workload, sessions=sessions,
                               description=f"{workload.description}; each session once in "
                                           f"{', '.join(protocols)}, interleaved")


def warmup_turn(sizer: Sizer, seed: int = 0) -> Turn:
    """A short request each target runs once, untimed, before the measured run."""
    text = make_text(
        sizer, random.Random(_SEEDS["warmup"] * 1_000_003 + seed), 16, lead="Warm-up request:"
    )
    return Turn(text, sizer.count(text), 4)
