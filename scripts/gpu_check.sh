#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the GPU-only tests (compiled Triton kernels in bf16, CUDA
# graphs against eager steps, pinned staging), then `tandem bench gpu` (Llama-3.1-8B's config,
# dummy weights, with profiler tables, the KV cache in bf16, fp8 and int8), then the 8B cold start
# against dd. Uses python3 from
# PATH (torch with CUDA, triton, transformers; set PYTHON to choose another) and this checkout
# on PYTHONPATH. Each stage has its own time limit and a failed stage does not stop the next;
# the output goes to the terminal and to gpu-check.log, figures and tables beside it, under
# $OUT (the lent machines' output folder) or ./bench-results.
#   STAGES="gemv tests bench int4 load" (default: all but gemv) picks stages; BENCH_ARGS replaces the
#   bench's own arguments (default: --kv-cache-dtypes auto,fp8,int8). The gemv stage times tandem's
#   one-row GEMV against cuBLAS (`tandem bench gpu --gemv`) and puts the device's table it writes
#   into this checkout's tandem/kernels/gpu/gemv_configs/, so the stages after it run with it
#   (commit the table from $OUT to keep it).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-bench-results}
mkdir -p "$DEST"
LOG="$DEST/gpu-check.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
if [ -d .wheelhouse ] && ! "$PY" -c "import tandem.cli.main, tandem.llm" 2>/dev/null; then
  echo "==> installing tandem's imports from .wheelhouse (scripts/gpu_wheelhouse.sh) into /tmp/tandem-site" | tee -a "$LOG"
  mapfile -t wanted < <(sed -n '/^PACKAGES=(/,/)/p' scripts/gpu_wheelhouse.sh | tr -d '()' | sed 's/PACKAGES=//' | tr ' ' '\n' | grep .)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/tandem-site --find-links .wheelhouse \
    "${wanted[@]}" 2>&1 | tee -a "$LOG"
  export PYTHONPATH="$PWD:/tmp/tandem-site${PYTHONPATH#"$PWD"}"
fi

stage() {  # stage NAME SECONDS COMMAND...: run it under a time limit, log it, report its status
  local name=$1 limit=$2
  shift 2
  echo "==> $name (at most ${limit}s): $*" | tee -a "$LOG"
  local started=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  echo "==> $name: exit ${PIPESTATUS[0]} after $((SECONDS - started))s" | tee -a "$LOG"
}
wants() { [[ " ${STAGES:-tests bench int4 load} " == *" $1 "* ]]; }
install_gemv_table() {  # the table the gemv stage wrote, into this checkout for the stages after it
  local table
  table=$(ls -t "$DEST"/gemv/gpu-gemv-*/*.json 2>/dev/null | grep -v /results.json | head -1)
  [ -n "$table" ] && mkdir -p tandem/kernels/gpu/gemv_configs && cp "$table" tandem/kernels/gpu/gemv_configs/ && echo "installed $table:" && cat "$table"
}

stage environment 60 "$PY" -c "
import torch, triton, transformers
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)
print(torch.cuda.get_device_name(), torch.cuda.mem_get_info())
import tandem.cli.main, tandem.llm
print('tandem imports: ok')"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee -a "$LOG"

wants gemv && stage gemv "${GEMV_LIMIT:-240}" "$PY" -m tandem bench gpu --gemv --output-dir "$DEST/gemv" \
  && install_gemv_table 2>&1 | tee -a "$LOG"
wants tests && stage tests "${TESTS_LIMIT:-180}" "$PY" -m pytest -q -p no:cacheprovider tests/kernels/gpu/test_on_gpu.py
wants bench && stage bench "${BENCH_LIMIT:-300}" "$PY" -m tandem bench gpu --profile ${BENCH_ARGS:---kv-cache-dtypes auto,fp8,int8} --output-dir "$DEST"
# Kimi K2.5's INT4 expert GEMM (Triton W4A16) at 1-64 rows per expert against its packed bytes' copy bound
wants int4 && stage int4 "${INT4_LIMIT:-240}" "$PY" -m tandem bench gpu --int4-moe --output-dir "$DEST/int4"

# Cold start: a random Llama-3.1-8B checkpoint (16 GB of bf16 safetensors, drawn on the GPU)
# written to local disk, then loaded onto the GPU through pinned staging, against dd.
CKPT="${TMPDIR:-/tmp}/tandem-llama-3.1-8b-random"
if wants load; then
  [ -f "$CKPT/config.json" ] || stage checkpoint 180 "$PY" -c "
import sys
from pathlib import Path
from tandem.bench.cold_start import write_random_checkpoint
write_random_checkpoint(Path('tandem/bench/configs/llama-3.1-8b.json'), Path('$CKPT'), device='cuda')"
  stage load "${LOAD_LIMIT:-240}" "$PY" -m tandem bench cold-start "$CKPT" --device cuda --dtype bfloat16 \
    --repeats "${LOAD_REPEATS:-2}" --warmup 0 --no-warm --output-dir "$DEST"
fi
grep -E "^==> |tok/s|TFLOP/s|GB/s|KV:|GEMV|passed|failed|Error" "$LOG" | tail -40
