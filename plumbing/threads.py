"""OpenMP spin settings that must be in place before torch (and its OpenMP runtime) loads, and
MKL's strict reproducible mode (`strict_blas`), which must be in place before its first call.

Measured on this project's 2-core machines (tiny model, forward+backward of one step):
- libgomp's default wait spins idle worker threads for a long time. Alone that is fastest
  (0.12 s), but next to another busy process (the local engine, another job) spinning threads
  starve each other: 4.5 s per step, 25-40x slower.
- OMP_WAIT_POLICY=PASSIVE never spins: 0.19 s under contention, but ~25% slower when alone.
- GOMP_SPINCOUNT=10000 spins briefly, then sleeps: as fast as the default when alone and
  0.3-0.5 s under contention. That is the default set here.
A second thread that also runs OpenMP-parallel torch ops (a second "team") slows both teams
down by ~60% with the default wait; the training backend therefore keeps all of its torch work,
model loading included, on its one worker thread.

Importing this module applies the default (`training` and `engines.local` import it first
thing); an OMP_WAIT_POLICY or GOMP_SPINCOUNT already in the environment wins.
"""

from __future__ import annotations

import os


def bounded_openmp_spin() -> None:
    """Set GOMP_SPINCOUNT=10000 unless the user chose a wait policy (no effect once torch loaded)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


bounded_openmp_spin()


def strict_blas() -> None:
    """MKL's strict reproducible mode (MKL_CBWR=AUTO,STRICT) unless the user chose a mode.

    Without it a float32 matrix product on CPU can round differently with the operands' memory
    alignment (measured: weights 16-byte aligned vs 8 bytes past it changed 4 of 150 tiny-model
    sequences' logprobs by ~5e-7), and FSDP2's gathered parameters sit at other offsets than a
    loaded model's. No speed difference measured. MKL reads it at its first call in the
    process: call this before any torch work (the exact-logprobs mode does, first thing).
    """
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
