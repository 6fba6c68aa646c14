#!/bin/bash
# `make test-slurm`: a 3-step RL run on the tiny model submitted with `rollouts launch --submit`
# to a one-node Slurm cluster started on this machine (tests/slurm/start_local_slurm.sh; root,
# Debian's slurm-wlm and munge). The script starts a local engine (`python -m engines.local`) in
# one srun step and the trainer under torchrun in another, on the same node (share_nodes).
# Passes when the job ends with exit code 0 and metrics.jsonl holds steps 1..3.
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
steps=$("$PY" -c "import json; print(sorted({r['step'] for r in map(json.loads, open('$RUN/run/metrics.jsonl')) if 'step' in r}))" || true)
echo "steps in metrics.jsonl: $steps"
[ "$rc" -eq 0 ] && [ "$steps" = "[1, 2, 3]" ] && echo "test-slurm: PASS" && exit 0
echo "test-slurm: FAIL" >&2
exit 1
