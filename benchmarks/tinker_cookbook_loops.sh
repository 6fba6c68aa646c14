#!/usr/bin/env bash
# tinker-cookbook 0.6.1's own recipes/sl_loop.py and recipes/rl_loop.py, unmodified, against
# `rollouts tinker-serve` on the tiny model: CPU only, no Hugging Face Hub (only PyPI).
#
#   bash benchmarks/tinker_cookbook_loops.sh        # or: make test-cookbook
#
# What it sets up (docs/tinker.md, "tinker-cookbook's own loops", says why):
# - a SEPARATE venv for the cookbook ($CBVENV): the cookbook pins tml-renderers>=0.4.1, which
#   is only needed for Inkling/Kimi-K3 tokenizers (lazily imported); it is installed --no-deps
#   with its other dependencies (torch pinned to a CPU build) and math-rl's (rl_loop imports
#   math_grading). The server runs from the project's venv ($PY).
# - an offline Hugging Face cache ($WORK/hf, benchmarks/cookbook_offline_hub.py): the tiny
#   tokenizer under the HF id given as model_name=, and small stand-ins for
#   HuggingFaceH4/no_robots and openai/gsm8k with their columns.
# - for the RL run that trains: a base model that already writes \boxed{n} (this project's SFT
#   of the tiny model, 80 steps), since a random model never earns a GSM8K reward and rl_loop
#   then skips every training step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
WORK=${WORK:-$ROOT/runs/cookbook}
CBVENV=${CBVENV:-$WORK/venv}
PORT=${PORT:-18641}
NAME=Qwen/Qwen3-4B-Instruct-2507 # its recommended renderer, qwen3_instruct, is plain ChatML
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH=$ROOT
mkdir -p "$WORK/logs"

if [ ! -x "$CBVENV/bin/python" ] || ! "$CBVENV/bin/python" -c "import tinker_cookbook, math_verify" 2>/dev/null; then
  echo "== cookbook venv $CBVENV"
  "$PY" -m venv "$CBVENV"
  "$CBVENV/bin/pip" install -q torch==2.13.0 # pinned: an unpinned torch pulls a CUDA build
  "$CBVENV/bin/pip" install -q aiohttp anyio blobfile chz cloudpickle datasets huggingface-hub \
    numpy pillow pydantic pyrage rich safetensors termcolor tiktoken tinker==0.38.0 tqdm \
    "transformers>=4.57.6,!=5.3.0,!=5.4.*,!=5.5.0,!=5.5.1,!=5.5.2,!=5.5.3,!=5.6.*" \
    "math-verify>=0.5.0" "pylatexenc>=2.0" "sympy>=1.12.0"
  "$CBVENV/bin/pip" install -q --no-deps tinker-cookbook==0.6.1
fi
CB=$CBVENV/bin/python

echo "== tiny model, offline HF cache"
[ -f "$WORK/tiny_model/config.json" ] || "$PY" examples/make_tiny_model.py --output "$WORK/tiny_model"
"$CB" benchmarks/cookbook_offline_hub.py --hf-home "$WORK/hf" --tokenizer-from "$WORK/tiny_model" \
  --model-name "$NAME" >"$WORK/logs/hub.log" 2>&1
export HF_HOME=$WORK/hf HF_HUB_OFFLINE=1 TINKER_API_KEY=tml-local

SERVER=
serve() { # serve MODEL_DIR: start `rollouts tinker-serve` on it and wait until it answers
  [ -z "$SERVER" ] || { kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; }
  "$PY" -m rollouts.tinker_server --model "$1" --model-name "$NAME" --port "$PORT" \
    --run-dir "$WORK/tinker_runs" --device cpu --num-threads 1 >"$WORK/logs/server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 300); do
    grep -q "^tinker API on" "$WORK/logs/server.log" && return 0
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 1
  done
  echo "tinker-serve on $1 did not come up within 300 s (port $PORT busy? set PORT=):" >&2
  tail -20 "$WORK/logs/server.log" >&2
  exit 1
}
trap '[ -z "$SERVER" ] || kill "$SERVER"' EXIT
recipe() { # recipe NAME LOG_DIR [chz overrides...]
  local name=$1 dir=$2
  shift 2
  (cd "$WORK" && "$CB" -m "tinker_cookbook.recipes.$name" base_url="http://127.0.0.1:$PORT" \
    model_name="$NAME" log_path="$dir" "$@") >"$dir.log" 2>&1
}
summary() { # summary LOG_DIR KEY...: first and last value of each metric
  "$CB" - "$@" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
for key in sys.argv[2:]:
    vals = [r[key] for r in rows if key in r]
    print(f"  {key}: {len(vals)} steps, first {vals[0]:.4f}, last {vals[-1]:.4f}")
EOF
}

serve "$WORK/tiny_model"
echo "== sl_loop (no_robots stand-in, 64 rows, 8 steps of 8, save_state at step 4)"
rm -rf "$WORK/sl"
recipe sl_loop "$WORK/sl" batch_size=8 save_every=4
summary "$WORK/sl" train_mean_nll train_mean_bpb
echo "== sl_loop again on the same log_path: resumes from its final state (create_training_client_from_state_with_optimizer)"
recipe sl_loop "$WORK/sl" batch_size=8 save_every=4
grep -o "Resuming from batch [0-9]*" "$WORK/sl.log"

echo "== rl_loop, default loss (stable_reinforce), random tiny model: reward 0, every step skipped"
rm -rf "$WORK/rl_default"
recipe rl_loop "$WORK/rl_default" batch_size=4 group_size=4 max_tokens=32 max_steps=2
summary "$WORK/rl_default" reward/total
echo "  training steps skipped (all advantages zero): $(grep -c "all advantages zero" "$WORK/rl_default.log")"

echo "== a base model that writes \\boxed{n}: this project's SFT of the tiny model (80 steps)"
BOXED=$WORK/boxed/sft/checkpoints/step_000080
if [ ! -f "$BOXED/config.json" ]; then
  "$CB" benchmarks/cookbook_offline_hub.py --boxed-sft "$WORK/boxed/sft.jsonl"
  "$PY" examples/run_sft.py --config configs/sft_tiny.yaml --data "$WORK/boxed/sft.jsonl" \
    --model "$WORK/tiny_model" --output-dir "$WORK/boxed/sft" --max-steps 80 --overwrite \
    train.batch_size=8 optim.lr=3e-3 optim.warmup_steps=5 train.eval_every=1000 \
    train.checkpoint_every=1000 >"$WORK/logs/boxed_sft.log" 2>&1
fi
tail -1 "$WORK/logs/boxed_sft.log"
serve "$BOXED"
echo "== rl_loop, loss_fn=importance_sampling, on that model"
rm -rf "$WORK/rl_is"
recipe rl_loop "$WORK/rl_is" batch_size=8 group_size=8 max_tokens=16 \
  loss_fn=importance_sampling
summary "$WORK/rl_is" reward/total grad_norm
echo "== rl_loop, default loss (stable_reinforce), on that model: the server refuses it"
rm -rf "$WORK/rl_sr"
if recipe rl_loop "$WORK/rl_sr" batch_size=8 group_size=8 max_tokens=16 max_steps=1; then
  echo "  stable_reinforce ran (unexpected: the server has no definition of it)"
else
  grep -o "loss_fn 'stable_reinforce'[^.]*" "$WORK/rl_sr.log" | head -1
fi
echo "logs: $WORK/*.log, metrics: $WORK/{sl,rl_default,rl_is}/metrics.jsonl"
