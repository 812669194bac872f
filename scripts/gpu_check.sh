#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the GPU-only tests (compiled Triton kernels in bf16, CUDA
# graphs against eager steps, pinned staging), then `tandem bench gpu` (Llama-3.1-8B's config,
# dummy weights). Uses the python on PATH (torch with CUDA, triton, transformers) and this
# checkout on PYTHONPATH; prints everything, writes the bench's JSON under $OUT or ./bench-results.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
if [ -d .wheelhouse ] && ! python -c "import tandem.cli, tandem.llm" 2>/dev/null; then
  echo "==> installing tandem's imports from .wheelhouse (scripts/gpu_wheelhouse.sh)"
  mapfile -t wanted < <(sed -n '/^PACKAGES=(/,/)/p' scripts/gpu_wheelhouse.sh | tr -d '()' | sed 's/PACKAGES=//' | tr ' ' '\n' | grep .)
  python -m pip install -q --no-index --no-deps --find-links .wheelhouse "${wanted[@]}"
fi
python - <<'PY'
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
PY
python -m pytest -q -x -p no:cacheprovider tests/kernels/gpu/test_on_gpu.py "$@"
python -m tandem bench gpu --output-dir "${OUT:-bench-results}"
# Cold start: a random Llama-3.1-8B checkpoint (16 GB of bf16 safetensors) written to local
# disk, then loaded onto the GPU through pinned staging, against dd of the same files.
CKPT="${TMPDIR:-/tmp}/tandem-llama-3.1-8b-random"
[ -f "$CKPT/config.json" ] || python - "$CKPT" <<'PY'
import sys
from pathlib import Path
from tandem.bench.cold_start import write_random_checkpoint
write_random_checkpoint(Path("tandem/bench/configs/llama-3.1-8b.json"), Path(sys.argv[1]))
PY
python -m tandem bench load "$CKPT" --device cuda --dtype bfloat16 --repeats 2 --warmup 1 --no-warm \
  --output-dir "${OUT:-bench-results}"
