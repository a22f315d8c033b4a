#!/usr/bin/env bash
# speculators 0.9.0 on the prepared data (OUT/plan.json from prepare.py), in its own venv, on the CPU.
# Usage: benchmarks/peers/run_speculators.sh [OUT=runs/peers] [extra speculators train args...]
# Wall time and peak memory (max RSS) go to OUT/speculators/time.txt; the checkpoint to OUT/speculators/checkpoints.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-runs/peers}; shift || true
PY=${PEERS:-$HOME/.cache/headway/peers}/speculators/bin/python
plan() { python3 -c "import json,sys; p=json.load(open('$OUT/plan.json')); print(eval(sys.argv[1]))" "$1"; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
/usr/bin/time -v -o "$OUT/speculators/time.txt" "$PY" "$HERE/shims/speculators_cpu.py" train \
  --speculator-type eagle3 \
  --verifier-name-or-path "$(plan "p['target']")" \
  --data-path "$(plan "p['peers']['speculators']['data']")" \
  --d2t-path "$(plan "p['peers']['speculators']['d2t']")" --t2d-path "$(plan "p['peers']['speculators']['t2d']")" \
  --draft-vocab-size "$(plan "p['draft_vocab_size']")" \
  --target-layer-ids $(plan "' '.join(map(str, p['peers']['speculators']['aux_ids']))") \
  --epochs "$(plan "p['epochs']")" --lr "$(plan "p['lr']['speculators']")" \
  --train-data-ratio "$(plan "p['peers']['speculators']['train_data_ratio']")" --on-missing raise \
  --save-path "$OUT/speculators/checkpoints" \
  --loss-implementation eager --draft-attn-impl sdpa --num-workers 0 --hidden-states-dtype float32 \
  "$@" 2>&1 | tee "$OUT/speculators/train.log"
