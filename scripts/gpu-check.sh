#!/usr/bin/env bash
# What `nox -s gpu` runs, as one bounded script for a lent GPU machine (no nox or venv there: the machine's
# own CUDA torch, lazyckpt from src/). Each part has its own time limit so a hang still returns the logs.
#   OUT=dir bash scripts/gpu-check.sh      (logs: env.txt, tests.txt, bench.txt, bench.json in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BENCH_ARGS=${GPU_BENCH_ARGS:---device cuda --size 1b --steps 4 --rounds 1}
{
  nvidia-smi || true
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda,
    torch.cuda.is_available() and torch.cuda.get_device_name(0))"
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|lightning|pytorch-lightning|accelerate|safetensors|numpy) '
  df -h /tmp .; nproc; free -g
} 2>&1 | tee "$OUT/env.txt"
# The files holding gpu-marked tests (collecting every file would need moto and s3fs there).
timeout "${GPU_TESTS_S:-240}" "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider --timeout 150 \
  tests/test_gpu.py tests/test_load.py tests/test_distributed_local.py tests/test_accelerate_fsdp.py \
  tests/test_lightning_ddp.py 2>&1 | tee "$OUT/tests.txt"
echo "tests rc=${PIPESTATUS[0]}" | tee -a "$OUT/tests.txt"
# shellcheck disable=SC2086
timeout "${GPU_BENCH_S:-240}" "$PY" -m benchmarks.bench_core $BENCH_ARGS --no-progress --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.txt"
echo "bench rc=${PIPESTATUS[0]}" | tee -a "$OUT/bench.txt"
# DeepSpeed on CUDA (where deepspeed is installed there): lazy vs the stock engine, and DeepSpeed's
# DataStatesCheckpointEngine where the datastates package is installed (the row says why not otherwise).
if "$PY" -c "import deepspeed" 2>/dev/null; then
  timeout "${GPU_DS_S:-300}" "$PY" -m benchmarks.bench_deepspeed --device cuda --size 100m --stages 2 3 --threads 0 \
    --modes none torch lazy datastates --json "$OUT/deepspeed.json" 2>&1 | tee "$OUT/deepspeed.txt"
  echo "deepspeed rc=${PIPESTATUS[0]}" | tee -a "$OUT/deepspeed.txt"
else
  echo "deepspeed not installed: the DeepSpeed benchmark did not run" | tee "$OUT/deepspeed.txt"
fi
