#!/usr/bin/env bash
# SmolLM2-135M-Instruct EAGLE-3 heads built on one CUDA GPU, for the CPU benchmark: with the heads
# unpacked in runs/smollm2-eagle3-gpu/final, `SKIP_TRAIN=1 examples/smollm2_cpu.sh eagle3-gpu`.
#
#   GGUF=SmolLM2-135M-Instruct.Q4_1.gguf examples/smollm2_gpu.sh
#
# The same steps as the CPU recipes, sized for a GPU: the target writes its own prompts (headway prompts),
# answers them and the chat:train / chat:extra prompts greedily in float32 (batch 512), and the drafter
# trains online (the target runs at every step: on a GPU that costs less than storing features).
# Every step resumes. Knobs: SELF (self-written prompts, default 12000, written and answered in chunks of
# CHUNK, 3000), EPOCHS (4), TTT (6), TIME_LIMIT (minutes of training; the heads are saved where it stops) or
# DEADLINE (epoch seconds the whole job must end by: no new chunk of self-written prompts starts unless
# RESERVE seconds (330) and the last chunk's time are left, and training gets what is left but 90 s),
# STEPS_PER_S (the GPU's training steps a second at TRAIN_BATCH, 32: with a time limit, fewer epochs so the
# schedule ends inside it), RUNS (runs), PY (python3), LIMIT (a smoke test: that many prompts from each source),
# TRAIN_ARGS (more `headway train` options).
# With OUT set, the heads come back as a tar in 15 MiB parts (heads.tar.part-*) beside the logs.
# Measured on an H200 (benchmarks/results/smollm2-gpu/): answers ~10,400 tok/s, a 3,000-prompt chunk ~85 s,
# training 11.4 steps/s; each headway command spends ~15 s starting, even when it finds its work done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RUNS=${RUNS:-runs}
SELF=${SELF:-12000}
EPOCHS=${EPOCHS:-4}
TTT=${TTT:-6}
LIMIT=${LIMIT:-}
MAX_NEW=${MAX_NEW:-160}
BATCH=${BATCH:-512}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
hw() { echo "+ headway $* [$(date +%T)]" >&2; "$PY" -m headway "$@"; }
lim() { [[ -n "$LIMIT" ]] && echo "--limit $LIMIT"; true; }

if [[ -n "${GGUF:-}" ]]; then hw target build smollm2 --gguf "$GGUF"; else hw target build smollm2; fi
common=(--target smollm2 --max_new_tokens "$MAX_NEW" --temperature 0 --dtype float32 --batch_size "$BATCH"
        --shard_size "$BATCH" --seed 0)
# shellcheck disable=SC2046
hw distill --source chat:train --output "$RUNS/gpu-distill-train" "${common[@]}" $(lim)
# shellcheck disable=SC2046
hw distill --source chat:extra --output "$RUNS/gpu-distill-extra" "${common[@]}" $(lim)
hw distill --source chat:dev --output "$RUNS/gpu-distill-dev" "${common[@]}" --limit "${LIMIT:-96}"
parts=("$RUNS/gpu-distill-train" "$RUNS/gpu-distill-extra")

# Self-written prompts in chunks, each answered before the next is written, so a lent machine that runs
# short of time still trains on every chunk it finished.
left() { if [[ -n "${DEADLINE:-}" ]]; then echo $(( DEADLINE - $(date +%s) )); else echo 1000000000; fi; }
want=${LIMIT:-$SELF}; chunk=${CHUNK:-3000}; have=0; last=0; k=0
while (( have < want )); do
    if (( $(left) < ${RESERVE:-330} + last )); then
        echo "self-written prompts stop at $have: $(left) s left, the last chunk took $last s" >&2; break
    fi
    t0=$(date +%s); k=$((k + 1)); upto=$(( have + chunk < want ? have + chunk : want ))
    hw prompts --config configs/smollm2/prompts.yaml --output "$RUNS/gpu-prompts" --num "$upto" \
        --batch_size "$BATCH" --dtype float32
    rows=$(wc -l < "$RUNS/gpu-prompts/prompts.jsonl")  # whole batches: a few more than asked for
    end=$(( rows < upto ? rows : upto ))
    (( end > have )) || break
    sed -n "$((have + 1)),${end}p" "$RUNS/gpu-prompts/prompts.jsonl" > "$RUNS/gpu-prompts/chunk-$k.jsonl"
    hw distill --source "$RUNS/gpu-prompts/chunk-$k.jsonl" --output "$RUNS/gpu-distill-self-$k" "${common[@]}"
    parts+=("$RUNS/gpu-distill-self-$k")
    have=$end; last=$(( $(date +%s) - t0 ))
done
[[ -f "$RUNS/gpu-distill/headway_distill.json" ]] || hw merge "${parts[@]}" --output "$RUNS/gpu-distill"

if [[ -n "${DEADLINE:-}" ]]; then  # a machine lent until DEADLINE (epoch seconds): train until 90 s before it
    TIME_LIMIT=$(awk -v d="$DEADLINE" -v n="$(date +%s)" 'BEGIN { m = (d - n - 90) / 60; printf "%.2f", m < 1 ? 1 : m }')
fi
# With the GPU's training rate known (STEPS_PER_S; an H200 ran 11.4 at batch 32), the epochs shrink to what
# the time limit holds, so the learning-rate schedule runs to its end instead of being cut by time_limit
if [[ -n "${TIME_LIMIT:-}" && -n "${STEPS_PER_S:-}" ]]; then
    rows=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["rows"])' "$RUNS/gpu-distill/headway_distill.json")
    fit=$(awk -v r="$rows" -v s="$STEPS_PER_S" -v m="$TIME_LIMIT" -v b="${TRAIN_BATCH:-32}" \
        'BEGIN { e = 0.95 * s * m * 60 * b / r; printf "%.2f", e < 0.05 ? 0.05 : e }')
    if awk -v f="$fit" -v e="$EPOCHS" 'BEGIN { exit !(f < e) }'; then
        echo "epochs $EPOCHS -> $fit: what $TIME_LIMIT min hold at $STEPS_PER_S steps/s over $rows answers" >&2
        EPOCHS=$fit
    fi
fi
# TF32 matmuls in training only: the answers above come from a strict float32 target
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
# shellcheck disable=SC2086
hw train --config configs/smollm2/eagle3-gpu.yaml --data "$RUNS/gpu-distill" --eval_data "$RUNS/gpu-distill-dev" \
    --output_dir "$RUNS/smollm2-eagle3-gpu" --epochs "$EPOCHS" --eagle.ttt_steps "$TTT" \
    ${TIME_LIMIT:+--time_limit "$TIME_LIMIT"} ${TRAIN_ARGS:-}
unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE
if [[ -n "${OUT:-}" ]]; then
    tar -C "$RUNS/smollm2-eagle3-gpu" -cf - final | split -b 15M - "$OUT/heads.tar.part-"
    cp "$RUNS/smollm2-eagle3-gpu/log.jsonl" "$OUT/train-log.jsonl" 2>/dev/null || true
    # the answers too (token ids; xz), for CPU-side evaluation or more training
    tar -C "$RUNS" -cf - gpu-distill gpu-distill-dev | xz -T0 -6 > "$RUNS/gpu-distill.tar.xz"
    if [[ $(stat -c %s "$RUNS/gpu-distill.tar.xz") -lt 20000000 ]]; then  # beside the heads, within what comes back
        split -b 15M "$RUNS/gpu-distill.tar.xz" "$OUT/distill.tar.xz.part-"
    fi
fi
echo "done [$(date +%T)]" >&2
