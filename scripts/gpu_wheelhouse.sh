#!/usr/bin/env bash
# Wheels of what tandem imports beyond a GPU image's torch/triton/transformers, for a machine
# with no package index (the lent GPU machines): downloaded here into .wheelhouse for
# CPython 3.11 and 3.12, carried there, installed by scripts/gpu_check.sh when an import fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each listed with its own dependencies (installed --no-deps): the image's numpy, tokenizers,
# safetensors, jinja2 and tqdm (transformers') are kept.
PACKAGES=(fastapi starlette annotated-doc uvicorn h11 click httpx httpcore anyio idna sniffio certifi pydantic
          pydantic-core annotated-types typing-inspection typing-extensions xxhash psutil rich markdown-it-py
          mdurl pygments pyzmq prometheus-client opentelemetry-api)
PYTHON=${PYTHON:-.venv/bin/python}
# The versions this venv runs (tested together), not the newest: a newer one may need more.
mapfile -t PINNED < <("$PYTHON" -c "import importlib.metadata as m, sys
for name in sys.argv[1:]: print(f'{name}=={m.version(name)}')" "${PACKAGES[@]}")
rm -rf .wheelhouse
for version in 3.11 3.12; do
  "$PYTHON" -m pip download -q --only-binary=:all: --python-version "$version" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --no-deps -d .wheelhouse "${PINNED[@]}" 2>&1 | grep -v "^WARNING: Location" || true
done
du -sh .wheelhouse
