"""Claude Code and Codex, configured as a user configures them for a tandem endpoint
(`tests.support.agent_harnesses`).

scripts/setup.sh installs both from npm into folders of their own at the repository root
(`.claude-code/`, `.openai-codex/`). Everything here keeps a run offline but for the model
endpoint: a scratch HOME (and CODEX_HOME), telemetry, updates, plugin and marketplace syncs
switched off, no inherited ANTHROPIC_*/CLAUDE_*/OPENAI_*/CODEX_* or proxy settings. The
end-to-end tests (tests/launch/test_up_claude_code.py, test_up_codex.py) and the fixture
capture (tests/support/capture_harness_requests.py) share it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CLAUDE_CODE = Path(os.environ.get("TANDEM_CLAUDE_CODE_DIR", REPO_ROOT / ".claude-code")) / "node_modules/.bin/claude"
CODEX = Path(os.environ.get("TANDEM_CODEX_DIR", REPO_ROOT / ".openai-codex")) / "node_modules/.bin/codex"
API_KEY = "sk-tandem-harness-test"  # any key: the cluster under test has no --api-keys
CODEX_KEY_ENV = "TANDEM_API_KEY"

# Claude Code's built-in tools for a code-fixing task. Its default set is 14 tools (~36k
# characters of schemas, ~9k tokens): on a CPU every first turn would prefill them.
CLAUDE_CODE_TOOLS = "Read,Edit,Bash"

_INHERITED_PREFIXES = ("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_")
_PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}


def _clean_env(home: Path) -> dict[str, str]:
    """The test's environment minus anything that would point a harness elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_INHERITED_PREFIXES) and k.lower() not in _PROXY_VARS}
    home.mkdir(parents=True, exist_ok=True)
    return env | {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "NO_PROXY": "127.0.0.1,localhost",
    }


def claude_code_env(home: Path, base_url: str, max_output_tokens: int | None = None) -> dict[str, str]:
    """Claude Code pointed at `base_url` (its /v1/messages), nothing else reachable.

    `max_output_tokens` sets CLAUDE_CODE_MAX_OUTPUT_TOKENS (the `max_tokens` it sends; its own
    default is 32000)."""
    env = _clean_env(home) | {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": API_KEY,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # A CPU's cold first turn can take minutes (Claude Code's own limit is 10).
        "API_TIMEOUT_MS": "1200000",
    }
    if max_output_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output_tokens)
    return env


def claude_code_command(prompt: str, model: str, *extra: str, tools: str | None = CLAUDE_CODE_TOOLS) -> list[str]:
    """`claude -p PROMPT` in print mode, allowed to read, edit and run commands without asking.

    `--dangerously-skip-permissions` is refused as root (CI runs as root), so the tools are
    allowed by name with edits accepted. `tools=None` keeps Claude Code's default tool set."""
    command = [str(CLAUDE_CODE), "-p", prompt, "--model", model, "--output-format", "json",
               "--permission-mode", "acceptEdits"]
    if tools is not None:
        command += ["--tools", tools, "--allowedTools", tools]
    else:
        command += ["--allowedTools", "Read,Edit,Write,Bash,Glob,Grep"]
    return command + list(extra)


def codex_config(base_url: str, model: str, context_window: int = 32768, trimmed: bool = True) -> str:
    """A CODEX_HOME/config.toml with one provider, tandem, on the Responses wire API.

    Plugins, remote plugins and apps are off: with them on, Codex runs
    `git ls-remote https://github.com/openai/plugins` at start. `trimmed` also turns sub-agents
    and goals off: their tools are ~12k characters of schemas (a `namespace` tool of five
    functions among them) a CPU would prefill on every first turn."""
    lean = "goals = false\n\n[agents]\nenabled = false\n" if trimmed else ""
    return f"""\
model = "{model}"
model_provider = "tandem"
approval_policy = "never"
sandbox_mode = "workspace-write"
check_for_update_on_startup = false
model_context_window = {context_window}

[features]
plugins = false
remote_plugin = false
apps = false
{lean}
[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[model_providers.tandem]
name = "tandem"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "{CODEX_KEY_ENV}"
# A CPU's cold first turn can take minutes before its first event: Codex gives up on a
# stream after 5 silent minutes by default.
stream_idle_timeout_ms = 1200000
"""


def codex_env(home: Path, base_url: str, model: str, trimmed: bool = True) -> dict[str, str]:
    """Codex pointed at `base_url` (its /v1/responses): CODEX_HOME under `home`, config written."""
    env = _clean_env(home)
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(base_url, model, trimmed=trimmed))
    return env | {"CODEX_HOME": str(codex_home), CODEX_KEY_ENV: API_KEY}


def codex_command(prompt: str, *, resume_last: bool = False) -> list[str]:
    """`codex exec --json PROMPT` (or a follow-up in the last session, `exec resume --last`)."""
    if resume_last:
        return [str(CODEX), "exec", "--json", "resume", "--last", prompt]
    return [str(CODEX), "exec", "--json", prompt]


def scratch_repo(root: Path) -> Path:
    """A git repository with one small bug to fix: `add` subtracts."""
    repo = root / "repo"
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "README.md").write_text("# calc\n")
    git = ["git", "-c", "user.email=test@example.com", "-c", "user.name=test"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run([*git, *args], cwd=repo, check=True)
    return repo
