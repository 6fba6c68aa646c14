#!/bin/bash
# `make test-slurm`: a 3-step RL run on the tiny model submitted with `rollouts launch --submit`
# to a one-node Slurm cluster started on this machine (tests/slurm/start_local_slurm.sh; root,
# Debian's slurm-wlm and munge). The script starts a local engine (`python -m engines.local`) in
# one srun step and the trainer under torchrun in another, on the same node (share_nodes).
# Passes when the job ends with exit code 0 and metrics.jsonl holds steps 1..3, and when a
# second run whose trainer is SIGKILLed after its first checkpoint is requeued by its script
# and finishes on attempt 1.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
RUN=${SLURM_TEST_DIR:-/tmp/rollouts-test-slurm}
"$ROOT/tests/slurm/start_local_slurm.sh"
rm -rf "$RUN" && mkdir -p "$RUN"
cd "$ROOT"
PYTHONPATH=$ROOT "$PY" -c "from training.backend.tiny_model import build_tiny_model as b; b('$RUN/model')"
cat > "$RUN/cluster.yaml" <<YAML
name: rl-tiny-slurm
run_dir: $RUN/run
workdir: $ROOT
python: $PY
env: {PYTHONPATH: "$ROOT", OMP_NUM_THREADS: "1"}
inference: {nodes: 1, engine: local, servers_per_node: 1, threads: 1, model: $RUN/model, startup_timeout_s: 300}
trainer: {nodes: 1, procs_per_node: 1}
slurm: {share_nodes: true, time: "00:20:00", max_attempts: 1}
YAML
start=$SECONDS
set +e
PYTHONPATH=$ROOT "$PY" -c 'import sys; from training.recipes.cli import main; sys.exit(main())' \
  launch --config configs/rl_tiny.yaml \
  --cluster "$RUN/cluster.yaml" --submit --wait \
  train.max_steps=3 rollout.batch_size=2 rollout.n_samples_per_prompt=4 train.eval_every=100 \
  train.eval_samples=8 train.checkpoint_every=3 backend.num_threads=1 \
  data.task_dir="$RUN/data" data.arithmetic.n_sft=16 data.arithmetic.n_rl=64 data.arithmetic.n_eval=8
rc=$?
set -e
echo "== job ended with exit code $rc after $((SECONDS - start)) s; logs:"
find "$RUN/run/logs" -type f | sort
for f in "$RUN"/run/logs/slurm-*.out "$RUN"/run/logs/job-*/attempt-*/*.log; do
  echo "== $f"; tail -15 "$f"
done
steps() {  # the steps logged in a run's metrics.jsonl, sorted, each once
  "$PY" -c "import json, sys; print(sorted([r['step'] for r in map(json.loads, open(sys.argv[1])) if 'step' in r]))" "$1" || true
}
steps1=$(steps "$RUN/run/metrics.jsonl")
echo "steps in metrics.jsonl: $steps1"
if [ "$rc" -ne 0 ] || [ "$steps1" != "[1, 2, 3]" ]; then echo "test-slurm: FAIL (the run)" >&2; exit 1; fi

# 2. Requeue: the trainer of a second run is SIGKILLed once its first checkpoint is written;
# the script requeues the job and attempt 1 resumes from that checkpoint to step 3.
sed -i -e "s#run_dir: $RUN/run\$#run_dir: $RUN/requeue#" -e 's/max_attempts: 1/max_attempts: 2/' \
  -e 's/name: rl-tiny-slurm/name: rl-tiny-requeue/' "$RUN/cluster.yaml"
job=$(PYTHONPATH=$ROOT "$PY" -c 'import sys; from training.recipes.cli import main; sys.exit(main())' \
  launch --config configs/rl_tiny.yaml --cluster "$RUN/cluster.yaml" --submit \
  train.max_steps=3 rollout.batch_size=2 rollout.n_samples_per_prompt=4 train.eval_every=100 \
  train.eval_samples=8 train.checkpoint_every=1 backend.num_threads=1 \
  data.task_dir="$RUN/data" data.arithmetic.n_sft=16 data.arithmetic.n_rl=64 data.arithmetic.n_eval=8 \
  | sed -n 's/^submitted job //p')
echo "== requeue run: job $job"
deadline=$((SECONDS + 300))
until [ -d "$RUN/requeue/checkpoints/step_000001" ]; do
  if ((SECONDS > deadline)); then echo "test-slurm: FAIL (no checkpoint after 300 s)" >&2; scancel "$job"; exit 1; fi
  sleep 1
done
killed=
for pid in $(pgrep -f -- "--output-dir $RUN/requeue"); do  # the rank: not torchrun, srun or bash
  cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null || true)
  case "$cmd" in *torch.distributed.run*|*srun*|*bash*|"") continue ;; esac
  kill -9 "$pid" && killed="$killed $pid"
done
echo "SIGKILLed the trainer rank(s):$killed"
[ -n "$killed" ] || { echo "test-slurm: FAIL (no trainer process found)" >&2; scancel "$job"; exit 1; }
deadline=$((SECONDS + 600))
while squeue -h -j "$job" 2>/dev/null | grep -q .; do
  if ((SECONDS > deadline)); then echo "test-slurm: FAIL (job $job still queued after 600 s)" >&2; scancel "$job"; exit 1; fi
  sleep 2
done
cat "$RUN"/requeue/logs/slurm-*.out
steps2=$(steps "$RUN/requeue/metrics.jsonl")
echo "attempts: $(ls "$RUN/requeue/logs/job-$job" | tr '\n' ' ')steps in metrics.jsonl: $steps2"
grep -h "resumed from" "$RUN/requeue/logs/job-$job/attempt-1/"trainer-*.log || true
if [ -d "$RUN/requeue/logs/job-$job/attempt-1" ] && [ "$steps2" = "[1, 2, 3]" ] \
   && grep -q "trainer exited with 0 (attempt 1)" "$RUN"/requeue/logs/slurm-*.out; then
  echo "test-slurm: PASS"; exit 0
fi
echo "test-slurm: FAIL (requeue)" >&2
exit 1
