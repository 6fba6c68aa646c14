"""CPU thread settings that must be in place before torch (and its OpenMP runtime) loads.

On a small CPU machine the trainer and the local engine share the cores. OpenMP's default
"active" wait makes idle worker threads spin, and two processes spinning on the same 2 cores
slow each other down 10-25× (measured: a 2-thread forward+backward of the tiny model took
4.5 s instead of 0.19 s next to a busy engine). Passive waiting costs nothing measurable when
the machine is otherwise idle. Importing this module applies it (`training` and
`engines.local` import it first thing); an explicit OMP_WAIT_POLICY in the environment wins.
"""

from __future__ import annotations

import os


def prefer_passive_openmp_wait() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user chose a policy (no effect once torch loaded)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


prefer_passive_openmp_wait()
