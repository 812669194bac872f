#!/usr/bin/env bash
# One command for a newcomer: set everything up, then chat with the default model.
# Extra arguments go to `tandem chat` (e.g. --max-tokens 64 or a model path).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${TANDEM_VENV:-.venv}/bin/tandem" chat "$@"
