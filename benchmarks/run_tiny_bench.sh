#!/usr/bin/env bash
# A one-minute smoke run of the whole bench pipeline: the `tiny` demo-target preset (~1 min to
# build, cached) and random-weight heads of every kind. Acceptance is near zero by construction;
# the run checks that every method works, agrees with greedy, and shows the decoders' overhead.
#
#   benchmarks/run_tiny_bench.sh [extra `headway bench` options...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
TARGET=$("$PY" -c "from headway.demo.builder import TargetBuildConfig as C, build_demo_target as b; print(b(C(preset='tiny')))")
HEADS=$("$PY" benchmarks/random_heads.py "$TARGET" "$OUT/tiny-random-heads" | tail -1)
mkdir -p "$OUT"
# shellcheck disable=SC2086
"$PY" -m headway bench --target "$TARGET" --heads $HEADS --prompts demo:heldout --num-prompts 4 \
    --max-new-tokens 64 --temperature 0 1 --repeats 2 --threads "${THREADS:-1}" \
    --json "$OUT/tiny-bench.json" --plot "$OUT/tiny-bench.png" "$@" | tee "$OUT/tiny-bench.txt"
