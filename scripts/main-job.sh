#!/usr/bin/env bash
# The main job (README): set up .venv if needed, then train a small GPT with a checkpoint every
# step through Lightning, lazily and with the stock plugin, and print the stall side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m examples.lightning_gpt "$@"
