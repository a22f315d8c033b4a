#!/usr/bin/env bash
# CUDA exactness + 8B-shaped speed check for the decoder (< 8 minutes on one H200).
# Usage: bash benchmarks/gpu_check.sh [--compile] [--tau 2 3 4]; --dry-run: the tiny CPU version (seconds)
# Installs the project into a venv if needed (torch from PyPI's default CUDA build: TORCH_SPEC=torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import headway, torch" 2>/dev/null; then
  python3 -m pip install -q -e . 2>&1 | tail -2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
python3 benchmarks/gpu_check.py "$@"
