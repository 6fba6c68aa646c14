"""Moved to `plumbing.threads` (shared plumbing); importing this path still applies the OpenMP
spin default, for code written against it."""

import plumbing.threads  # noqa: F401  (sets OpenMP's wait policy before torch loads)
from plumbing.threads import bounded_openmp_spin as bounded_openmp_spin
