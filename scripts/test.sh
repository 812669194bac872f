#!/usr/bin/env bash
# Set up (idempotent), lint, and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${TANDEM_VENV:-.venv}"
echo "==> ruff"
"$VENV/bin/ruff" check tandem tests
echo "==> pytest"
"$VENV/bin/python" -m pytest -q "$@"
