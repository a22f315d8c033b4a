#!/usr/bin/env bash
# The numbers behind the README's performance section: `headway bench` on the demo target with
# the heads the demo run trained, against HF generate / assisted generation / prompt lookup.
#
#   benchmarks/run_demo_bench.sh [RUN_DIR] [extra `headway bench` options...]
#
# RUN_DIR (default: runs) is searched for trained heads: every `final` checkpoint folder whose
# config.json has a "kind" (runs/demo-medusa/final, runs/demo-eagle3/final/heads, ...).
# The target is the one those heads were trained on (recorded in their config.json), else the
# demo target (`--target demo`); set TARGET=... to override. Results land in OUT (default:
# benchmarks/results): demo-bench.{txt,json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs}
shift $(( $# > 0 ? 1 : 0 ))
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

mapfile -t FOUND < <("$PY" - "$RUN_DIR" <<'PY'
import json, sys
from pathlib import Path

heads, targets = [], []
for cfg in sorted(Path(sys.argv[1]).glob("**/final/**/config.json")) + sorted(Path(sys.argv[1]).glob("**/final/config.json")):
    try:
        c = json.loads(cfg.read_text())
    except (OSError, ValueError):
        continue
    if "kind" in c and str(cfg.parent) not in heads:
        heads.append(str(cfg.parent))
        targets.append((c.get("target") or {}).get("name_or_path") or "")
print(" ".join(heads))
known = [t for t in targets if t and Path(t).is_dir()]
print(known[0] if known and all(t == known[0] for t in known) else "demo")
PY
)
HEADS=${FOUND[0]:-}
TARGET=${TARGET:-${FOUND[1]:-demo}}
if [[ -z "$HEADS" ]]; then
    echo "no trained heads under $RUN_DIR (looked for */final/**/config.json with a \"kind\"); run the demo first" >&2
    exit 1
fi
mkdir -p "$OUT"
echo "target: $TARGET" >&2
echo "heads:  $HEADS" >&2
# shellcheck disable=SC2086  # HEADS is a space-separated list on purpose
"$PY" -m headway bench --target "$TARGET" --heads $HEADS --prompts demo:heldout --num-prompts 8 \
    --max-new-tokens 128 --temperature 0 1 --repeats 3 --threads "${THREADS:-1}" \
    --json "$OUT/demo-bench.json" --plot "$OUT/demo-bench.png" "$@" | tee "$OUT/demo-bench.txt"
