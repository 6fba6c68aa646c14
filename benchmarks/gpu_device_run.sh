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
# tail shows what was measured even if the call is cut off. GPU_CHECK_ARGS=--dry-run runs the
# same steps on CPU (the tiny model), to try this script without a GPU.
set -uo pipefail

OUT=${OUT:-/tmp/gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
SITE=${GPU_CHECK_SITE:-/tmp/site}
mkdir -p "$OUT"

# Only what the image lacks or has older: a carried wheel shadows the image's copy from
# PYTHONPATH, so one the image has at the same or a newer version stays out (an older trio or
# typing-extensions than the project's needs gets the carried one). The project's own wheel
# stays out too: the project runs from this checkout.
mapfile -t wheels < <(python3 - <<'PY'
import glob, importlib.metadata as md, os, sys
from packaging.version import Version
for w in sorted(glob.glob("wheels/*.whl")):
    name, version = os.path.basename(w).split("-")[:2]
    if name == "rollouts":
        continue
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is not None and Version(have) >= Version(version):
        print(f"gpu_device_run: {name}: the image's {have}", file=sys.stderr)
    else:
        print(w)
PY
)
if ((${#wheels[@]} == 0)) && ! python3 -c "import trio, pydantic, orjson" 2>/dev/null; then
    echo "gpu_device_run: no usable wheels/*.whl: run make wheels here and name wheels in carry" >&2
    exit 2
fi
if ((${#wheels[@]})); then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}" 2>&1 | tail -5
fi

export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
{
    nvidia-smi
    python3 -c 'import sys, torch, transformers; print(sys.version); print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
} >"$OUT/device.txt" 2>&1
tail -1 "$OUT/device.txt"

# A second call, when the session's device time allows (the check comes first: it is the
# project's GPU evidence): `GPU_RUN=recipes bash benchmarks/gpu_device_run.sh` runs
# benchmarks/gpu_recipes.sh on CUDA instead (the recipes end to end, colocated mode's memory per
# phase, exact logprobs and a broadcast refit; ~3.5 min; GPU_RECIPES_ONLY="colocate ..." trims it).
if [ "${GPU_RUN:-check}" = recipes ]; then
    ONLY=${GPU_RECIPES_ONLY:-} PYTHON=python3 timeout -k 10 "${GPU_RECIPES_TIMEOUT_S:-560}" \
        bash benchmarks/gpu_recipes.sh "${GPU_RECIPES_DEVICE:-cuda}" /tmp/gpu_recipes 2>&1 | tee "$OUT/gpu_recipes.log"
    rc=${PIPESTATUS[0]}
    for f in /tmp/gpu_recipes/*.log; do cp "$f" "$OUT/recipe_$(basename "$f")"; done
    for f in /tmp/gpu_recipes/w/*/metrics.jsonl; do
        cp "$f" "$OUT/metrics_$(basename "$(dirname "$f")").jsonl"
    done
    echo "gpu_device_run: gpu_recipes.sh exit status $rc" | tee -a "$OUT/gpu_recipes.log"
    exit "$rc"
fi

# the script's budget covers its own work; 35 s more for the interpreter, CUDA's start and exit
timeout -k 10 $((${BUDGET%.*} + 35)) python3 benchmarks/gpu_check.py --budget-s "$BUDGET" \
    --results "$OUT/RESULTS.md" --profile "$OUT/gpu_check_profile.txt" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
why=""
((rc == 124)) && why=" (killed by timeout: the rows printed above were measured)"
echo "gpu_device_run: gpu_check.py exit status $rc$why" | tee -a "$OUT/gpu_check.log"
exit "$rc"
