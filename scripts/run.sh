#!/usr/bin/env bash
# One command for a newcomer: set everything up, then start a local tandem cluster on the
# default model: a router on :8000 in front of one prefill and one decode worker, answering
# OpenAI requests. Extra arguments go to `tandem up` (e.g. --port 9000, --workers 2, a model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${TANDEM_VENV:-.venv}/bin/tandem" up "$@"
