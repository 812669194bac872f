#!/usr/bin/env bash
# Wheels of what tandem imports beyond a GPU image's torch/triton/transformers, for a machine
# with no package index (the lent GPU machines): downloaded here into .wheelhouse for
# CPython 3.10-3.12, carried there, installed by scripts/gpu_check.sh when an import fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each listed with its own dependencies (installed --no-deps): the image's numpy, tokenizers,
# safetensors, jinja2 and tqdm (transformers') are kept.
PACKAGES=(fastapi starlette annotated-doc uvicorn h11 click httpx httpcore anyio idna sniffio certifi pydantic
          pydantic-core annotated-types typing-inspection typing-extensions xxhash psutil rich markdown-it-py
          mdurl pygments pyzmq prometheus-client)
for version in 3.10 3.11 3.12; do
  "${PYTHON:-.venv/bin/python}" -m pip download -q --only-binary=:all: --python-version "$version" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --no-deps -d .wheelhouse "${PACKAGES[@]}" 2>&1 | grep -v "^WARNING: Location" || true
done
du -sh .wheelhouse
