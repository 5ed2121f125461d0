#!/usr/bin/env bash
# The main job (README): set up .venv if needed, then train a small GPT with Lightning, a checkpoint every
# step: with the stock plugin, lazily to one folder, and lazily by level (a memory level every step, a disk
# level every 5); print the stall per checkpoint side by side and the time to resume from each level.
# Then the transformers Trainer row: stock vs lazy checkpoint-N folders, same seed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m examples.lightning_gpt "$@"
echo
.venv/bin/python -m examples.transformers_trainer --compare 2>&1 | grep -v -e Warning -e '^\[transformers\]' -e 'Writing model shards' -e "^{'train_runtime'"
