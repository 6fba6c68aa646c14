#!/usr/bin/env bash
# The GPU check in ONE call of the workplace's device tool (DEVELOPERS.md, "The GPU check on a
# machine without network"). The tool runs a bash command in a copy of the repository on a GPU
# machine without network; `$OUT` is a folder whose files come back; ignored paths travel only
# when the call names them in `carry` (64 MiB in all). So, here: `make wheels WHEELS_PYTHON=3.12
# WHEELS_PLATFORM=manylinux2014_x86_64`, then one call:
#
#   run(command="bash benchmarks/gpu_device_run.sh", carry=["wheels"], timeout_s=600)
#
# It unpacks the carried wheels beside the image's torch and transformers (no index, no
# dependency resolution: nothing of the image is replaced), runs benchmarks/gpu_check.py under
# `timeout` with its time budget (GPU_CHECK_BUDGET_S, default 540 s: the script skips optional
# rows that would not fit and still writes its table), and leaves in $OUT: RESULTS.md (the
# gpu_check section), gpu_check_profile.txt (top ops of one SFT step and one GRPO update),
# gpu_check.log (everything it printed, the BENCH_RESULT line included) and device.txt
# (nvidia-smi, the versions). Each finished row prints one line at once, so the tool's output
# tail shows what was measured even if the call is cut off.
set -uo pipefail

OUT=${OUT:-/tmp/gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
SITE=${GPU_CHECK_SITE:-/tmp/site}
mkdir -p "$OUT"

shopt -s nullglob
wheels=()
for w in wheels/*.whl; do
    [[ $(basename "$w") == rollouts-* ]] || wheels+=("$w")  # the project runs from the checkout
done
if ((${#wheels[@]} == 0)); then
    echo "gpu_device_run: no wheels/*.whl here: build them with make wheels and name wheels in carry" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}" 2>&1 | tail -5

export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
{
    nvidia-smi
    python3 -c 'import sys, torch, transformers; print(sys.version); print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
} >"$OUT/device.txt" 2>&1
tail -1 "$OUT/device.txt"

# the script's budget covers its own work; 35 s more for the interpreter, CUDA's start and exit
timeout -k 10 $((${BUDGET%.*} + 35)) python3 benchmarks/gpu_check.py --budget-s "$BUDGET" \
    --results "$OUT/RESULTS.md" --profile "$OUT/gpu_check_profile.txt" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_device_run: gpu_check.py exit status $rc (124: killed by timeout)" | tee -a "$OUT/gpu_check.log"
exit "$rc"
