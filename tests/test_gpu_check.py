"""benchmarks/gpu_check.py --dry-run: the GPU check's code path (FSDP2 in a group of one, SFT and
GRPO steps, the local engine, a weight sync) runs on CPU and reports sane figures, so the
script a GPU machine runs cannot rot unnoticed."""

from __future__ import annotations

import json
import math
import os

from tests import warm_python
from tests.distributed_launch import ROOT


def test_the_gpu_check_dry_run_reports_finite_positive_figures_and_writes_its_section(tmp_path):
    results = tmp_path / "RESULTS.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = warm_python.run([ROOT / "benchmarks" / "gpu_check.py", "--dry-run", "--results", results,
                            "--profile", tmp_path / "profile.txt"], cwd=tmp_path, env=env,
                           timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT "))
    figures = json.loads(line.removeprefix("BENCH_RESULT "))
    for phase in ("sft", "sft_fused", "grpo"):
        for key in ("step_s", "tokens_per_s", "tflops", "mfu", "peak_memory_gib"):
            value = figures[phase][key]
            assert math.isfinite(value) and value > 0, (phase, key, value)
        assert math.isfinite(figures[phase]["loss"])
    assert figures["engine"]["tokens_per_s"] > 0 and figures["weight_sync_s"] > 0
    assert figures["served_version"] == figures["trained_version"] == "3"  # 2 + the profiled one
    # the fused row trains the same batches from the same weights: the same loss up to rounding
    assert (
        abs(figures["sft_fused"]["loss"] - figures["sft"]["loss"]) < 1e-3 * figures["sft"]["loss"]
    )
    for text in (proc.stdout, results.read_text()):
        assert "| SFT step " in text and "| GRPO update" in text and "MFU" in text
        assert "| SFT step, fused AdamW" in text
    section = results.read_text()
    assert "<!-- begin gpu_check -->" in section and "Dry run" in section
    assert "| MFU (hardware)" in section and "| GPU busy" in section
    # one row per change of issue 43 (benchmarks/gpu_variants.py): the same batches from the
    # same weights, so the same losses and grad norms up to bf16 rounding
    variants = figures["variants"]
    assert list(variants) == ["today", "+accumulate", "+segments", "+large micro-batch",
                              "+compile"]  # fmt: skip
    assert variants.pop("+compile")["error"].startswith("skipped on CPU")
    for phase in ("sft", "grpo"):
        base = variants["today"][phase]
        for name, row in variants.items():
            f = row[phase]
            for key in ("step_s", "tokens_per_s", "tflops", "hw_tflops", "peak_memory_gib"):
                assert math.isfinite(f[key]) and f[key] > 0, (name, phase, key, f[key])
            assert f["gpu_busy"] is None  # no CUDA events on CPU
            assert abs(f["loss"] - base["loss"]) <= 2e-2 * abs(base["loss"]) + 1e-3, (name, phase)
            assert abs(f["grad_norm"] - base["grad_norm"]) <= 2e-2 * base["grad_norm"], name
        assert variants["+large micro-batch"][phase]["hw_tflops"] > 0
    # --profile: both phases' top ops, the backend thread's matmuls and optimizer among them
    profile = (tmp_path / "profile.txt").read_text()
    sft, grpo = profile.split("## GRPO update")
    for table in (sft, grpo):
        assert "aten::mm" in table and "Self CPU" in table, table[:2000]
    assert "Optimizer.step" in sft


def test_a_failed_fused_phase_is_a_table_row_not_a_lost_run(monkeypatch):
    """If the fused-AdamW phase raises on some GPU or torch, the other phases' figures are
    still reported and its row names the error (the script then exits 1)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    ok = {"step_s": 1.0, "tokens_per_s": 10.0, "tflops": 0.5, "peak_memory_gib": 1.0, "loss": 2.0}
    figures = {"n_params": 1, "process_group": "nccl", "sft": dict(ok), "grpo": dict(ok),
               "sft_fused": {"error": "RuntimeError: no fused kernel for DTensor"},
               "engine": {"tokens_per_s": 5.0, "generate_s": 1.0}, "weight_sync_s": 0.1,
               "served_version": "2", "trained_version": "2"}  # fmt: skip
    (table,), _ = gpu_check.report(gpu_check.DRY, figures, 1e12, "peak")
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "failed: RuntimeError: no fused kernel for DTensor" in rows["SFT step, fused AdamW"]
    assert "0.5" in rows["SFT step"] and "0.5" in rows["GRPO update"]
