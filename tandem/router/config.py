"""Router configuration: frozen dataclasses, plus the worker-list file (`--config`).

The worker list is the only part that changes while the router runs (`POST /workers/reload`
or SIGHUP re-read the file), so it is parsed by a plain function that returns a new tuple
of `WorkerSpec`s instead of mutating the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tandem.config import RequestLimits

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
# File keys: `worker` names colocated workers (role "both"), as the --worker flag does.
_FILE_KEYS: dict[str, Role] = {
    "prefill": "prefill",
    "decode": "decode",
    "worker": "both",
    "workers": "both",
    "both": "both",
}


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    role: Role


@dataclass(frozen=True)
class DiscoveryTarget:
    """A DNS name whose addresses are workers of one role: a Kubernetes headless Service
    (one A record per ready pod), or any name with several records."""

    role: Role
    host: str
    port: int
    scheme: str = "http"

    def url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address  # an IPv6 address
        return f"{self.scheme}://{host}:{self.port}"

    def describe(self) -> str:
        """As the flag reads: `worker=` for colocated workers."""
        role = "worker" if self.role == "both" else self.role
        return f"{role}={self.scheme}://{self.host}:{self.port}"


def parse_discovery_target(text: str) -> DiscoveryTarget:
    """`ROLE=HOST:PORT` or `ROLE=http://HOST:PORT`, ROLE one of prefill, decode, worker/both."""
    role_text, sep, rest = text.partition("=")
    role = _FILE_KEYS.get(role_text.strip())
    if not sep or role is None:
        raise ValueError(f"--discover {text!r}: expected ROLE=HOST:PORT with ROLE prefill, decode or worker")
    scheme, _, hostport = rest.strip().rpartition("://")
    host, colon, port = hostport.rstrip("/").rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--discover {text!r}: expected HOST:PORT after {role_text}=, e.g. "
                         f"{role_text}=tandem-{role_text}.default.svc.cluster.local:8000")
    if scheme not in ("", "http", "https"):
        raise ValueError(f"--discover {text!r}: scheme must be http or https")
    return DiscoveryTarget(role, host.strip("[]"), int(port), scheme or "http")


@dataclass(frozen=True)
class HealthPolicy:
    """Polling and the up/down state machine (SGLang's gateway uses 3 down / 2 up too)."""

    interval_s: float = 0.5
    timeout_s: float = 2.0
    failures_to_down: int = 3
    successes_to_up: int = 2


@dataclass(frozen=True)
class Timeouts:
    """Per hop. A non-streamed reply sends its headers only when generation ends, so the
    first-byte limit bounds a whole non-streamed request and is generous by default; a stream's
    headers come at once and its first event after the request's wait in the worker's queue,
    which the first-byte limit bounds too (the idle limit is for gaps after it)."""

    connect_s: float = 5.0
    first_byte_s: float = 600.0
    idle_s: float = 120.0
    # A wait on a worker its health checks marked down (a cut link: silence, no reset) ends
    # once it has been silent this long; a stream still flowing from it goes on.
    down_silence_s: float = 5.0


@dataclass(frozen=True)
class RetryPolicy:
    """Retries before the client saw a byte: other workers of the same pool first, after a
    backoff with full jitter (a random pause up to backoff_s × multiplier^n, so retries after
    one failure do not arrive together), within a budget (resilience/retry_budget.py):
    retries at most `budget_ratio` of the requests over `budget_window_s`, plus a floor of
    `budget_min_per_s` so that a quiet router may retry at all."""

    max_attempts: int = 3
    backoff_s: float = 0.05
    backoff_multiplier: float = 2.0
    jitter: bool = True
    budget_ratio: float = 0.2
    budget_min_per_s: float = 1.0
    budget_window_s: float = 10.0

    def __post_init__(self) -> None:
        if self.budget_ratio < 0 or self.budget_min_per_s < 0 or self.budget_window_s <= 0:
            raise ValueError("--retry-budget and --retry-budget-min must be >= 0")


@dataclass(frozen=True)
class BreakerPolicy:
    """A worker's circuit breaker (resilience/breaker.py): `failures` within `window_s`
    open it for `cooldown_s`, doubling per failed trial up to `max_cooldown_s`."""

    failures: int = 5
    window_s: float = 10.0
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"--breaker-failures must be >= 1, got {self.failures}")
        if self.window_s <= 0 or self.cooldown_s <= 0:
            raise ValueError("--breaker-window and --breaker-cooldown must be > 0")
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError("the breaker's longest cool-down must be >= --breaker-cooldown")


@dataclass(frozen=True)
class AdmissionPolicy:
    """The router's bounded queue (resilience/admission.py); max_in_flight 0: no bound."""

    max_in_flight: int = 256
    max_queue: int = 1024
    queue_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 0 or self.max_queue < 0 or self.queue_timeout_s <= 0:
            raise ValueError("--max-in-flight and --max-queue must be >= 0, --queue-timeout > 0")


@dataclass(frozen=True)
class ScoringConfig:
    # Weight of one running sequence in the decode score, whose main term is the KV fraction
    # in use (0..1): 0.01 makes 100 sequences weigh as much as a full KV cache.
    decode_sequence_weight: float = 0.01
    # A routed request stays in the router's own count of a worker's load until a /load poll
    # that started this long after the dispatch has answered (the worker's figures lag).
    reflect_delay_s: float = 0.25


PolicyName = Literal["round_robin", "least_tokens", "session", "kv_aware"]
POLICIES: tuple[PolicyName, ...] = ("kv_aware", "least_tokens", "session", "round_robin")


# kv_aware's tier credits until a worker has measured its own (placement/policies.py): a
# conservative guess for a GPU worker, where a forward pass is cheap next to a disk read.
FALLBACK_TIER_CREDITS = {"cpu": 0.75, "disk": 0.25, "cluster": 0.25}


@dataclass(frozen=True)
class PolicyConfig:
    """How a request's worker is chosen; the rules and formula are in router/placement/policies.py."""

    name: PolicyName = "kv_aware"
    # Read after x-session-affinity and before the body's `user` field.
    affinity_header: str | None = None
    # Bounded loads: no worker above ceil(c × average in-flight requests) takes a new one.
    balance_factor: float = 1.25
    virtual_nodes: int = 150
    # w in kv_aware's cost = w × prefill tokens + decode tokens. Dynamo's default is 1; 4
    # here because a prefill token costs a whole forward pass while a token of a running
    # sequence's KV costs one attention read per decode step (placement/policies.py).
    prefill_weight: float = 4.0
    # kv_aware's credit for a cached prompt block by the tier it would come from: the fraction
    # of that block's prefill a hit there saves (a device hit saves all of it, 1.0, fixed; a
    # lower tier's block must be loaded first). None: measured on each worker from its own
    # loads and prefill rate, with the fallback below until it has measured them; a number
    # fixes it. 0 leaves a tier out of routing. See "Tier credits" in placement/policies.py.
    kv_credit_cpu: float | None = None
    kv_credit_disk: float | None = None
    kv_credit_cluster: float | None = None
    tokenize_timeout_s: float = 2.0
    kv_events_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if self.balance_factor < 1.0:
            raise ValueError(f"--balance-factor must be >= 1, got {self.balance_factor}")
        if self.virtual_nodes < 1 or self.prefill_weight < 0:
            raise ValueError("virtual_nodes must be >= 1 and --prefill-weight >= 0")
        for medium, credit in self.tier_credits.items():
            if not 0.0 <= credit <= 1.0:
                raise ValueError(f"--kv-credit-{medium} must be between 0 and 1, got {credit}")

    @property
    def tier_credits(self) -> dict[str, float]:
        """Credit per KV medium (events' `medium`), device first: the fixed ones, and the
        fallbacks for those measured per worker."""
        given = {"cpu": self.kv_credit_cpu, "disk": self.kv_credit_disk, "cluster": self.kv_credit_cluster}
        return {"device": 1.0, **{m: FALLBACK_TIER_CREDITS[m] if c is None else c for m, c in given.items()}}

    @property
    def measured_media(self) -> tuple[str, ...]:
        """Tiers whose credit each worker's measurements set (no --kv-credit-* given)."""
        given = {"cpu": self.kv_credit_cpu, "disk": self.kv_credit_disk, "cluster": self.kv_credit_cluster}
        return tuple(m for m, c in given.items() if c is None)


@dataclass(frozen=True)
class AccountingConfig:
    """Prices, the usage ledger and API keys (router/accounting/: pricing, ledger, auth)."""

    prices_file: Path | None = None  # None: every model is free (costs reported as 0)
    ledger_path: Path | None = None  # None: no ledger (`tandem route` defaults to a file)
    api_keys_file: Path | None = None  # None: no keys; every caller is "anonymous"
    worker_api_key: str | None = field(default=None, repr=False)
    usage_admins: tuple[str, ...] = ()  # identities that may read everyone's /v1/usage
    # Per-key defaults where the key file sets none (None: unlimited); accounting/limits.py.
    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None
    quota_tokens_per_day: int | None = None


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[WorkerSpec, ...] = ()  # from flags; the file's workers are added to these
    config_file: Path | None = None
    # DNS names re-resolved every discover_interval_s; their addresses are added to the above.
    discover: tuple[DiscoveryTarget, ...] = ()
    discover_interval_s: float = 5.0
    tokenizer: Path | None = None
    # Below this many prompt tokens the prefill hop costs more than it saves: a second HTTP
    # round trip and a KV transfer to spare the decode worker a prefill of a few ms.
    pd_min_prompt_tokens: int = 256
    health: HealthPolicy = field(default_factory=HealthPolicy)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    limits: RequestLimits = field(default_factory=RequestLimits)
    shutdown_timeout_s: float = 30.0  # SIGTERM: drain this long at most (tandem/edge/drain.py)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    accounting: AccountingConfig = field(default_factory=AccountingConfig)
    # Times a stream may move to another worker when its worker fails mid-response
    # (http/migration.py); 0 turns migration off.
    migration_limit: int = 3
    # With API keys, each identity's requests get their own cache_salt (trust/fields.py);
    # True lets tenants share cached prompt KV (faster, but a timing side channel).
    shared_prefix_cache: bool = False
    # The cluster's shared secret (tandem/trust): the router signs every request to its workers
    # with it, makes tenants' cache salts from it, and it opens the control plane when no
    # admin key is given. Prefill/decode splits and stream migration need it.
    cluster_secret: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)  # bearer token for the control plane
    public_metrics: bool = False  # /metrics, /workers, /dashboard open even with keys on
    install_sighup: bool = False  # only the main thread of a `tandem route` process may
    log_level: str = "info"
    access_log: bool = False
    # Where /v1/responses keeps responses for previous_response_id and GET: "memory" (this
    # router's) or a Redis/Valkey URL that every replica shares (tandem up: its KV store's).
    response_store: str = "memory"

    def __post_init__(self) -> None:
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(
                f"--pd-min-prompt-tokens must be >= 0, got {self.pd_min_prompt_tokens}"
            )
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.discover_interval_s <= 0:
            raise ValueError(f"--discover-interval must be > 0, got {self.discover_interval_s}")
        if self.retry.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.retry.max_attempts}")
        if self.health.failures_to_down < 1 or self.health.successes_to_up < 1:
            raise ValueError("--down-after and --up-after must be >= 1")


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` → `http://host:port` (no trailing slash, no /v1)."""
    url = url.strip()
    if not url:
        raise ValueError("empty worker URL")
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def specs_from_lists(
    prefill: list[str] | tuple[str, ...] = (),
    decode: list[str] | tuple[str, ...] = (),
    both: list[str] | tuple[str, ...] = (),
) -> tuple[WorkerSpec, ...]:
    specs = [WorkerSpec(normalize_url(u), "prefill") for u in prefill]
    specs += [WorkerSpec(normalize_url(u), "decode") for u in decode]
    specs += [WorkerSpec(normalize_url(u), "both") for u in both]
    return dedupe(specs)


def dedupe(specs: list[WorkerSpec]) -> tuple[WorkerSpec, ...]:
    seen: set[WorkerSpec] = set()
    out = []
    for spec in specs:
        if spec not in seen:
            seen.add(spec)
            out.append(spec)
    return tuple(out)


def parse_worker_file(text: str, suffix: str = ".json") -> tuple[WorkerSpec, ...]:
    """`{prefill: [url...], decode: [...], worker: [...]}` as JSON, or YAML when PyYAML is there.

    An entry is a URL string or `{url: ...}`. Unknown keys are refused: a typo (`decoder:`)
    would otherwise silently empty a pool.
    """
    data = _load(text, suffix)
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise ValueError(
            "the worker file must hold a mapping {prefill: [...], decode: [...], worker: [...]}"
        )
    specs: list[WorkerSpec] = []
    for key, entries in data.items():
        role = _FILE_KEYS.get(str(key))
        if role is None:
            raise ValueError(
                f"unknown key {key!r} in the worker file (expected prefill, decode or worker)"
            )
        if entries is None:
            continue
        if isinstance(entries, str | dict):
            entries = [entries]
        if not isinstance(entries, list):
            raise ValueError(f"{key}: expected a list of URLs")
        for entry in entries:
            url = entry.get("url") if isinstance(entry, dict) else entry
            if not isinstance(url, str):
                raise ValueError(f"{key}: each entry must be a URL or {{url: ...}}, got {entry!r}")
            specs.append(WorkerSpec(normalize_url(url), role))
    return dedupe(specs)


def _load(text: str, suffix: str) -> Any:
    if suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - PyYAML comes with transformers
            raise ValueError(
                "YAML worker files need PyYAML (pip install pyyaml); or write the file as JSON"
            ) from exc
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"the worker file is not valid YAML: {exc}") from exc
    try:
        return json.loads(text) if text.strip() else None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the worker file is not valid JSON: {exc}") from exc


def read_worker_file(path: Path) -> tuple[WorkerSpec, ...]:
    return parse_worker_file(path.read_text(), path.suffix)


def all_worker_specs(config: RouterConfig) -> tuple[WorkerSpec, ...]:
    """The flags' workers plus the file's (read now: this is what a reload calls)."""
    from_file = read_worker_file(config.config_file) if config.config_file else ()
    return dedupe([*config.workers, *from_file])
