#!/usr/bin/env bash
# The LoRA study's grid as recorded in results.md: two processes share the arm x seed runs of one --out
# (run.py: shared_runs), both write the same report when every run is done. The arms are every arm
# that ran (results.md says which ran when and how many processes shared the CPU; a run's result does not depend on
# that). full_lr3e-4 is the lr control: every parameter at the adapters' lr (10 x --lr). Over finished runs the same
# command line trains nothing and rewrites the report (arms whose runs are missing are trained first).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/lora_study}
ITER=${ITER:-10}
mkdir -p "$(dirname "$OUT")"
ARGS=(--stage1 experiments/sdrl_study/checkpoint/stage1_choice --tasks pick fill --iterations "$ITER" --seeds 0 1 2
      --eval-per-task 32 --lr 3e-5 --arms full full_lr3e-4 r4_attn r16_attn r64_attn r4_all r16_all r64_all --out "$OUT"
      --compile-cache "${CACHE:-$OUT/xla_cache}" --override sdrl.sd_target=state_argmax_agree
      --train-stream experiments/sdrl_study/configs/stage0_ar.yaml:4500 --train-stream experiments/sdrl_study/configs/stage1.yaml:
      --train-stream experiments/sdrl_study/configs/ar_control.yaml: --train-stream experiments/sdrl_study/configs/stage1_more.yaml:
      --train-stream experiments/sdrl_study/configs/choice.yaml:)
nice -n 5 python experiments/lora_study/run.py "${ARGS[@]}" > "$OUT.worker.log" 2>&1 &
sleep 20  # the first process claims stage 1's rows first
nice -n 5 python experiments/lora_study/run.py "${ARGS[@]}" --results-md experiments/lora_study/results.md \
    --results-json experiments/lora_study/results.json --figures experiments/lora_study/figures
wait
