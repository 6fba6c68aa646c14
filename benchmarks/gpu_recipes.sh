#!/bin/bash
# The recipes' device paths, end to end on the tiny model, 3-4 steps each: SFT, GRPO with a KL
# reference (prompt-shared rows: `share_prompts` is on by default), PPO (critic), LoRA GRPO
# (adapters hot-loaded into the engine) and online DPO (pairwise loss), the trainer and the
# launched local engine both on DEVICE: what benchmarks/gpu_check.py, which calls the backend
# directly, does not cover. Run it beside that check on a GPU machine. Not the multi-turn tool
# recipe: the base model calls no tool, so it would run one turn (it needs the checkpoint of
# configs/tool_sft_tiny.yaml first).
# Then two recipes of paths no GPU has run yet:
# - colocate: `engines.colocate=true` (the engine releases its memory while the trainer trains,
#   resumes before each push); prints each step's memory per phase in GiB (issue 47): the
#   engine's (weight, and on CUDA the allocator's allocated / reserved / peak_allocated) after
#   generation, after the release and after the resume, the whole GPU's used memory at each, and
#   the trainer's peak while it trains (docs/engines.md, colocated mode).
# - exact_refit_distill: `engines.exact_logprobs=true` in bfloat16 on both sides (the engine
#   rescores each finished sequence with the trainer's numerics: prints logprob_diff_max_abs
#   per step, 0.0 when exact), weights pushed by broadcast (`engines.weight_transport=
#   distributed`, gloo: NCCL refuses two ranks on one GPU) and on-policy distillation from a
#   teacher engine on DEVICE (its prompt-logprob path).
#
#   PYTHON=python3 bash benchmarks/gpu_recipes.sh cuda /tmp/gpu_recipes
#
# Each recipe's log is OUTDIR/NAME.log and its run OUTDIR/w/NAME/ (metrics.jsonl); a line per
# recipe says its exit status and seconds. On CPU (DEVICE=cpu) the first five take ~70 s here
# on an idle machine; with other jobs on its 2 cores, 176 s for those five and 289 s for all
# seven (2026-12-07). On an H100 the first five took 154 s (session 15): expect ~3.5 min for
# all seven. ONLY="colocate exact_refit_distill" runs just the recipes named (space-separated).
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
wanted() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
run() {
    local name=$1 t0 rc; shift
    wanted "$name" || return 0
    t0=$(date +%s)
    timeout 300 "$PYTHON" "${cli[@]}" "$@" >"$out/$name.log" 2>&1; rc=$?
    echo "$name rc=$rc $(($(date +%s) - t0))s"
    if [ $rc != 0 ]; then tail -25 "$out/$name.log"; failed=1; fi
}
show() {  # NAME PREFIX: each step's metrics of run NAME whose names start with PREFIX
    wanted "$1" || return 0
    "$PYTHON" - "$out/w/$1/metrics.jsonl" "$2" <<'PY'
import json, sys
path, prefix = sys.argv[1], sys.argv[2]
try:
    rows = [json.loads(line) for line in open(path)]
except OSError as err:
    sys.exit(f"  no metrics: {err}")
for row in rows:
    shown = {k: v for k, v in row.items() if k.startswith(prefix)}
    print(f"  step {row['step']}: " + (", ".join(f"{k} {v:g}" for k, v in sorted(shown.items()))
                                       or f"no {prefix}* metric"))
PY
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
run colocate rl --config configs/rl_tiny.yaml --output-dir "$out/w/colocate" --max-steps 3 \
    "${common[@]}" engines.colocate=true
show colocate memory_
run exact_refit_distill rl --config configs/rl_tiny.yaml --output-dir "$out/w/exact_refit_distill" \
    --max-steps 3 "${common[@]}" engines.exact_logprobs=true model.dtype=bfloat16 \
    engines.local_dtype=bfloat16 backend.fsdp.param_dtype=bfloat16 \
    engines.weight_transport=distributed engines.weight_group_backend=gloo \
    algorithm.preset=distill "teacher.model=$M" "teacher.local_device=$dev"
show exact_refit_distill logprob_diff_max_abs
exit $failed
