#!/usr/bin/env bash
# Calibrated drafts, before and after (issue #18): on one target and its trained heads,
#   1. chains 1..6 and two dynamic trees, each dynamic tree ranked with and without the heads'
#      fitted draft calibration (`headway bench --calibration on off`), greedy;
#   2. `headway tune` per heads (the stored default, chosen with calibrated drafts);
#   3. the stored defaults, calibrated and not, side by side with the kinds' old default.
#
#   experiments/run_calibration_report.sh [RUN_DIR] [TARGET]     # defaults: runs/demo, demo
#
# Heads: RUN_DIR/{medusa,eagle1,eagle3}/final (what `headway demo` writes). Tuning writes the
# chosen tree into each heads' config.json: run it on copies if you want the originals untouched.
# Results: OUT (default benchmarks/results)/calibration-{trees,tuned}.{txt,json} and tune-<kind>.json.
# PROMPTS/NUM/TOKENS/THREADS size the benches, TREES the trees of step 1, TUNE_PROMPTS what tune
# chooses on (default PROMPTS; give another set, e.g. chat:train, so the benched prompts never chose),
# TUNE_ARGS more `headway tune` options (e.g. "--repeats 1 --probe-depth 4" on a slow target).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/demo}
TARGET=${2:-demo}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
PROMPTS=${PROMPTS:-demo:heldout}
NUM=${NUM:-8}
TOKENS=${TOKENS:-96}
THREADS=${THREADS:-2}
TUNE_PROMPTS=${TUNE_PROMPTS:-$PROMPTS}
TREES=${TREES:-chain-1 chain-2 chain-3 chain-4 chain-5 chain-6 dynamic-4-5-16 dynamic-4-6-24}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
HEADS=()
for kind in medusa eagle1 eagle3; do
  [[ -f "$RUN_DIR/$kind/final/config.json" ]] && HEADS+=("$RUN_DIR/$kind/final")
done
[[ ${#HEADS[@]} -gt 0 ]] || { echo "no heads under $RUN_DIR/{medusa,eagle1,eagle3}/final: run headway demo first" >&2; exit 1; }
COMMON=(--target "$TARGET" --prompts "$PROMPTS" --num-prompts "$NUM" --max-new-tokens "$TOKENS" --temperature 0
        --baselines none --assistant none --repeats 1 --threads "$THREADS")

echo "== 1. trees, calibrated and not ==" >&2
# shellcheck disable=SC2086  # TREES is a list
"$PY" -m headway bench "${COMMON[@]}" --heads "${HEADS[@]}" --calibration on off \
  --tree $TREES \
  --json "$OUT/calibration-trees.json" | tee "$OUT/calibration-trees.txt"

echo "== 2. tune (stores each heads' default tree) ==" >&2
for h in "${HEADS[@]}"; do
  # shellcheck disable=SC2086  # TUNE_ARGS is a list
  kind=$(basename "$(dirname "$h")")
  "$PY" -m headway tune --target "$TARGET" --heads "$h" --prompts "$TUNE_PROMPTS" --num-prompts "$NUM" \
    --json-out "$OUT/tune-$kind.json" --budget-s none ${TUNE_ARGS:-}
done

echo "== 3. stored defaults, calibrated and not ==" >&2
"$PY" -m headway bench "${COMMON[@]}" --heads "${HEADS[@]}" --calibration on off \
  --json "$OUT/calibration-tuned.json" | tee "$OUT/calibration-tuned.txt"
