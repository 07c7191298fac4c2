#!/usr/bin/env bash
# The coupled-target study on AGREE-whole (experiments/sdrl_study/coupled.md): 3 seeds of SD·RL with
# sdrl.sd_target=coupled_teacher, 3 seeds of a stage-1 continuation with about the same CPU time (the control), and
# the sampler frontier of stage 1, of each arm (one checkpoint per seed) and of the control, all on the same held-out
# prompts (disjoint from every training stream: the frontier refuses an overlap).
#
#   bash experiments/sdrl_study/coupled_study.sh runs/coupled          # OUT must not exist yet
#   ITERATIONS=24 CONTROL_STEPS=400 bash experiments/sdrl_study/coupled_study.sh runs/coupled
#
# Every step is skipped when its output exists, so a killed study resumes where it stopped.
set -euo pipefail
OUT=${1:?usage: coupled_study.sh OUT}
ITERATIONS=${ITERATIONS:-24}
CONTROL_STEPS=${CONTROL_STEPS:-400}
SEEDS=(0 1 2)
HERE=experiments/sdrl_study
STAGE1=$HERE/checkpoint/stage1_agree_whole
CONFIG=$HERE/configs/agree_whole_sdrl.yaml
STREAMS=(--train-stream $HERE/configs/agree_whole.yaml: --train-stream $HERE/configs/agree_whole_more.yaml:
         --train-stream $HERE/configs/agree_whole_control.yaml:$CONTROL_STEPS)
COUPLED=(optim.lr=1e-4 sdrl.sd_target=coupled_teacher sdrl.sd_weight=4.0 sdrl.sd_step_weighting=early)
mkdir -p "$OUT"

# 1. the coupled arm (run.py also evaluates at the default sampler on 8 prompts; the frontier below is the measure)
[ -d "$OUT/coupled" ] || python $HERE/run.py --stage1 $STAGE1 --config $CONFIG --tasks agree --arms sdrl \
    --seeds "${SEEDS[@]}" --iterations "$ITERATIONS" --eval-per-task 8 "${STREAMS[@]:0:4}" \
    --override "${COUPLED[@]}" --name coupled --out "$OUT/coupled" --compile-cache "$OUT/xla_cache"

# 2. the control: stage 1 continued (its own loss), same optimizer, CONTROL_STEPS steps per seed
for s in "${SEEDS[@]}"; do
  [ -d "$OUT/control/control_s$s/params" ] || dgemma train -c $HERE/configs/agree_whole_control.yaml --no-progress \
      checkpoint.init_from=$STAGE1 run.output_dir="$OUT/control" run.name=control_s$s run.seed=$s \
      trainer.steps="$CONTROL_STEPS"
done

# 3. the frontiers: EB default, a short sweep around it, and the fixed-count rule at K 1, 2, 4
FRONTIER=(--config $CONFIG --tasks agree "${STREAMS[@]}" --seeds "${SEEDS[@]}" --eval-per-task 32 --eval-batch 32
          --gamma 0.1 0.3 1.0 --temperatures 0.8:0.4 0.4:0.2 --max-steps --stability --accept-confidence
          --fixed-count-steps 1 2 4 --diversity)
[ -f "$OUT/frontier_stage1/frontier.json" ] || python $HERE/frontier.py --checkpoint $STAGE1 "${FRONTIER[@]}" \
    --out "$OUT/frontier_stage1" --title "stage 1 (AGREE-whole)"
[ -f "$OUT/frontier_coupled/frontier.json" ] || python $HERE/frontier.py \
    --checkpoint $(for s in "${SEEDS[@]}"; do echo "$OUT/coupled/coupled_sdrl_s$s/params"; done) "${FRONTIER[@]}" --out "$OUT/frontier_coupled" \
    --title "coupled_teacher, $ITERATIONS it (3 seeds)"
[ -f "$OUT/frontier_control/frontier.json" ] || python $HERE/frontier.py \
    --checkpoint $(for s in "${SEEDS[@]}"; do echo "$OUT/control/control_s$s/params"; done) "${FRONTIER[@]}" \
    --out "$OUT/frontier_control" --title "stage-1 continuation, $CONTROL_STEPS steps (3 seeds)"
