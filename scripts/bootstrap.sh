#!/usr/bin/env bash
# Create .venv (once) with torch first (a CPU build unless LAZYCKPT_TORCH says otherwise), then
# lazyckpt with its test, lightning, accelerate, s3 and transformers extras (the test extra has moto[server];
# LAZYCKPT_EXTRAS overrides the list). Safe to run again: it only fills gaps.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LAZYCKPT_VENV:-.venv}
TORCH_SPEC=${LAZYCKPT_TORCH:-torch==2.13.0}
EXTRAS=${LAZYCKPT_EXTRAS:-test,lightning,accelerate,s3,transformers}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
# LAZYCKPT_PINS: extra requirements installed with the project (the oldest supported frameworks, for example).
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" ${LAZYCKPT_PINS:-}
