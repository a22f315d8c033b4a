#!/usr/bin/env bash
# The real-target numbers in the README: SmolLM2-135M-Instruct end to end on 2 CPU cores.
#
#   examples/smollm2_cpu.sh [KINDS...]        # default: eagle3 eagle1 medusa; eagle3 trains on all
#                                                      # 3,108 chat:train answers, eagle1 and medusa on 1,536,
#                                                      # eagle3-6k on those and chat:extra's 2,814 more,
#                                                      # eagle3-10k on those and ~4,000 answers to prompts
#                                                      # the target wrote itself (headway prompts);
#                                                      # eagle3-12k fine-tunes the eagle3-10k heads (init_from)
#                                                      # on those and ~2,400 more self-written prompts' answers
#
# Every step is cached or resumable, so rerunning after an interruption continues where it stopped:
#   target build (~40 s, once) -> distill (configs/smollm2/distill.yaml, ~16 min)
#   -> features (configs/smollm2/features.yaml, 4 min with native bf16, ~15 without)
#   -> (any eagle3 kind: distill-smollm2-more.yaml, which keeps the features as it writes, merge; ~20 min more)
#   -> train each kind offline
#   -> tune (tree choice on chat:dev) -> bench on held-out prompts of other task
#      families (chat:heldout), T=0 and T=1, at 1 and 2 threads. HF generate and prompt lookup also run
#      with the decoder's linear kernel (hf-weight-major, hf-prompt-lookup-weight-major), so the table
#      separates what the kernel gains from what the drafts gain.
# Results: OUT (default benchmarks/results)/smollm2-bench-t{1,2}.{txt,json,png}.
# SKIP_TRAIN=1 benches whatever heads exist; BENCH_ARGS adds `headway bench` options; DISTILL_ARGS adds
# `headway distill` options (e.g. "--engine vllm --vllm-python /path/to/vllm-venv/bin/python --features none",
# ~1.4x faster here; vLLM returns no hidden states, so a features pass follows each distill);
# NUM, TOKENS, REPEATS and THREADS size the bench (defaults 12, 128, 2, "1 2");
# TUNE_PROMPTS is tune's prompt source (default chat:dev: prompts no head trained on and no bench times;
# on chat:train, the drafters' own training prompts, acceptance reads far higher than on new prompts).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
KINDS=("$@")
[[ ${#KINDS[@]} -gt 0 ]] || KINDS=(eagle3 eagle1 medusa)
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
NUM=${NUM:-12}
TOKENS=${TOKENS:-128}
REPEATS=${REPEATS:-2}
THREADS=${THREADS:-1 2}
TUNE_PROMPTS=${TUNE_PROMPTS:-chat:dev}
hw() { echo "+ headway $*" >&2; "$PY" -m headway "$@"; }
# a features folder that a distill with `features:` finished needs no features pass
complete() {
    "$PY" -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1])).get("complete"))' "$1/features.json" 2>/dev/null
}

hw target build smollm2
if [[ -z "${SKIP_TRAIN:-}" ]]; then
    # shellcheck disable=SC2086
    hw distill --config configs/smollm2/distill.yaml ${DISTILL_ARGS:-}
    hw features --config configs/smollm2/features.yaml
    # shellcheck disable=SC2086
    hw distill --config configs/smollm2/distill-heldout.yaml ${DISTILL_ARGS:-}  # evaluation rows, other task families
    hw features --config configs/smollm2/features-heldout.yaml
    if [[ " ${KINDS[*]} " == *" eagle3"* ]]; then  # the other 1,572 chat:train prompts, merged with the first run's
        # shellcheck disable=SC2086
        hw distill --config configs/smollm2/distill-more.yaml ${DISTILL_ARGS:-}
        complete runs/smollm2-features-more || hw features --config configs/smollm2/features-more.yaml
        [[ -f runs/smollm2-features-3k/features.json ]] || \
            hw merge runs/smollm2-features runs/smollm2-features-more --output runs/smollm2-features-3k
    fi
    if [[ " ${KINDS[*]} " =~ " eagle3-"(6k|10k|12k)" " ]]; then  # + chat:extra's 2,814 prompts (~30 min more)
        # shellcheck disable=SC2086
        hw distill --config configs/smollm2/distill-extra.yaml ${DISTILL_ARGS:-}
        complete runs/smollm2-features-extra || hw features --config configs/smollm2/features-extra.yaml
        [[ -f runs/smollm2-features-6k/features.json ]] || hw merge runs/smollm2-features \
            runs/smollm2-features-more runs/smollm2-features-extra --output runs/smollm2-features-6k
    fi
    if [[ " ${KINDS[*]} " =~ " eagle3-"(10k|12k)" " ]]; then  # + ~4,000 prompts the target writes itself (~50 min)
        hw prompts --config configs/smollm2/prompts.yaml
        # shellcheck disable=SC2086
        hw distill --config configs/smollm2/distill-self.yaml ${DISTILL_ARGS:-}
        complete runs/smollm2-features-self || hw features --config configs/smollm2/features-self.yaml
        [[ -f runs/smollm2-features-10k/features.json ]] || hw merge runs/smollm2-features-6k \
            runs/smollm2-features-self --output runs/smollm2-features-10k
    fi
    if [[ " ${KINDS[*]} " == *" eagle3-12k "* ]]; then  # + ~2,400 more of them (~40 min); fine-tunes eagle3-10k
        [[ -f runs/smollm2-eagle3-10k/final/config.json ]] || hw train --config configs/smollm2/eagle3-10k.yaml
        hw prompts --config configs/smollm2/prompts-eval.yaml   # 50 evaluation prompts, kept out of the rest
        hw prompts --config configs/smollm2/prompts-more.yaml
        # shellcheck disable=SC2086
        hw distill --config configs/smollm2/distill-self-more.yaml ${DISTILL_ARGS:-}
        complete runs/smollm2-features-self-more || hw features --config configs/smollm2/features-self-more.yaml
        [[ -f runs/smollm2-features-12k/features.json ]] || hw merge runs/smollm2-features-10k \
            runs/smollm2-features-self-more --output runs/smollm2-features-12k
    fi
fi
HEADS=()
for kind in "${KINDS[@]}"; do
    [[ -z "${SKIP_TRAIN:-}" ]] && hw train --config "configs/smollm2/$kind.yaml"
    final="runs/smollm2-$kind/final"
    [[ -f "$final/config.json" ]] || { echo "no heads at $final" >&2; exit 1; }
    # the tree is chosen on other prompts than the ones the bench times
    [[ -z "${SKIP_TRAIN:-}" ]] && hw tune --target smollm2 --heads "$final" --prompts "$TUNE_PROMPTS" \
        --num_prompts 6 --max_new_tokens 64 --temperatures 0 1 \
        --json_out "$OUT/smollm2-tune-$kind.json"  # a tree for each temperature: they differ here
    HEADS+=("$final")
done
for threads in $THREADS; do
    # no HF assisted baseline: no smaller model with SmolLM2's tokenizer can be had offline
    # shellcheck disable=SC2086
    hw bench --target smollm2 --heads "${HEADS[@]}" --prompts chat:heldout --num_prompts "$NUM" \
        --max_new_tokens "$TOKENS" --temperature 0 1 --repeats "$REPEATS" --threads "$threads" --baselines hf-prompt-lookup hf-weight-major hf-prompt-lookup-weight-major \
        --json "$OUT/smollm2-bench-t$threads.json" --plot "$OUT/smollm2-bench-t$threads.png" ${BENCH_ARGS:-} \
        | tee "$OUT/smollm2-bench-t$threads.txt"
done
