#!/bin/bash
# The recipes' device paths, end to end on the tiny model, 3-4 steps each: SFT, GRPO with a KL
# reference (prompt-shared rows: `share_prompts` is on by default), PPO (critic), LoRA GRPO
# (adapters hot-loaded into the engine) and online DPO (pairwise loss), the trainer and the
# launched local engine both on DEVICE: what benchmarks/gpu_check.py, which calls the backend
# directly, does not cover. Run it beside that check on a GPU machine. Not the multi-turn tool
# recipe: the base model calls no tool, so it would run one turn (it needs the checkpoint of
# configs/tool_sft_tiny.yaml first).
#
#   PYTHON=python3 bash benchmarks/gpu_recipes.sh cuda /tmp/gpu_recipes
#
# Each recipe's log is OUTDIR/NAME.log and its run OUTDIR/w/NAME/ (metrics.jsonl); a line per
# recipe says its exit status and seconds. On CPU (DEVICE=cpu) it takes ~70 s here.
dev=${1:?usage: gpu_recipes.sh DEVICE OUTDIR}; out=${2:?usage: gpu_recipes.sh DEVICE OUTDIR}
PYTHON=${PYTHON:-python3}
mkdir -p "$out/w"
"$PYTHON" -c "from training import ensure_tiny_model; ensure_tiny_model('$out/w/tiny')" || exit 1
M=$out/w/tiny
cli=(-c "import sys; from training.recipes.cli import main; sys.exit(main())")
common=(--model "$M" rollout.batch_size=4 rollout.n_samples_per_prompt=4 train.eval_samples=8
        train.eval_every=2 train.checkpoint_every=2 "backend.device=$dev"
        "engines.local_device=$dev" "data.task_dir=$out/w/data"
        reward.fn=rollouts.tasks.arithmetic:digit_share_reward)
failed=0
run() {
    local name=$1 t0 rc; shift
    t0=$(date +%s)
    timeout 300 "$PYTHON" "${cli[@]}" "$@" >"$out/$name.log" 2>&1; rc=$?
    echo "$name rc=$rc $(($(date +%s) - t0))s"
    if [ $rc != 0 ]; then tail -25 "$out/$name.log"; failed=1; fi
}
run sft sft --config configs/sft_tiny.yaml --model "$M" --output-dir "$out/w/sft" --max-steps 4 \
    "backend.device=$dev" "data.task_dir=$out/w/data"
run grpo_kl rl --config configs/rl_tiny.yaml --output-dir "$out/w/grpo_kl" --max-steps 3 \
    "${common[@]}" algorithm.overrides.kl_coef=0.04
run ppo rl --config configs/rl_tiny.yaml --output-dir "$out/w/ppo" --max-steps 3 \
    "${common[@]}" algorithm.preset=ppo
run lora rl --config configs/rl_tiny.yaml --output-dir "$out/w/lora" --max-steps 3 \
    "${common[@]}" model.lora.rank=8
run online_dpo rl --config configs/rl_tiny.yaml --output-dir "$out/w/online_dpo" --max-steps 3 \
    "${common[@]}" algorithm.preset=online_dpo
exit $failed
