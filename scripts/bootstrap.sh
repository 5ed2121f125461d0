#!/usr/bin/env bash
# Create .venv (once) with torch first (a CPU build unless LAZYCKPT_TORCH says otherwise), then
# lazyckpt with its test, lightning, accelerate, s3, transformers and deepspeed extras (the test extra has moto[server];
# LAZYCKPT_EXTRAS overrides the list). Safe to run again: it only fills gaps.
#
# Installer: torch with pip (pip honours this machine's pip configuration, where a local CPU wheel may
# lie; uv does not look there), the rest with uv where it can be installed (parallel downloads and one
# resolve: ~4x faster on a fresh clone), torch held at the installed version so nothing replaces it.
# LAZYCKPT_INSTALLER=pip, or no uv to be had, installs the rest with plain pip. Both write the packages'
# bytecode at install (uv only with --compile-bytecode): without it, where PYTHONDONTWRITEBYTECODE is set,
# every process compiled transformers, Lightning and DeepSpeed from source again (~2 s each).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LAZYCKPT_VENV:-.venv}
TORCH_SPEC=${LAZYCKPT_TORCH:-torch==2.13.0}
EXTRAS=${LAZYCKPT_EXTRAS:-test,lightning,accelerate,s3,transformers,deepspeed}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
# LAZYCKPT_PINS: extra requirements installed with the project (the oldest supported frameworks, for example).
# shellcheck disable=SC2086
if [ "${LAZYCKPT_INSTALLER:-uv}" = uv ] && "$VENV/bin/python" -m pip install -q uv >/dev/null 2>&1; then
  held="$VENV/torch-held.txt"
  "$VENV/bin/python" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' >"$held"
  "$VENV/bin/python" -m uv pip install -q --compile-bytecode --python "$VENV/bin/python" --constraint "$held" \
    -e ".[$EXTRAS]" ${LAZYCKPT_PINS:-}
else
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" ${LAZYCKPT_PINS:-}
fi
