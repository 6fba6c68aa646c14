"""How fast `rollouts view` opens a long run: a 300-step run directory, in headless chromium.

Writes a synthetic RL run directory in the real format (`rollouts.jsonl` by RolloutDumpWriter,
`metrics.jsonl` by JsonlLogger; tests/viewer_helpers.py: failures, truncation, tool turns,
branches), builds its site (`build_site`), then opens `index.html` from a file:// URL in
chromium `--repeats` times and reads the page's own clock from the dumped DOM: `data-ready-ms`
is `performance.now()` (ms since navigation start) when the first render (manifest, curves,
step list, the last step's groups) is done. Also printed: the wall time of the whole chromium
process against the same process on an empty page (its start-up and shut-down).

    .venv/bin/python benchmarks/viewer_load.py [--steps 300] [--groups 8] [--n 8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.viewer_helpers import CHROMIUM, have_chromium, write_synthetic_run  # noqa: E402
from training.viewer.site import build_site  # noqa: E402


def open_in_chromium(url: str) -> tuple[float | None, float]:
    """(the page's data-ready-ms, or None; chromium's wall seconds): no virtual time, real clocks."""
    start = time.perf_counter()
    out = subprocess.run([CHROMIUM, "--headless=new", "--disable-gpu", "--no-sandbox",
                          "--dump-dom", url], capture_output=True, text=True, timeout=120)  # fmt: skip
    wall = time.perf_counter() - start
    ready = re.search(r'data-ready-ms="([\d.]+)"', out.stdout)
    return (float(ready.group(1)) if ready else None), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--tokens", type=int, default=48, help="response tokens per sample")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not have_chromium():
        print("no chromium: apt-get install chromium", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        run = write_synthetic_run(Path(tmp) / "run", steps=args.steps, groups=args.groups,
                                  n=args.n, tokens=args.tokens)  # fmt: skip
        t0 = time.perf_counter()
        index = build_site(run)
        built = time.perf_counter() - t0
        files = list((index.parent / "data").iterdir())
        size = sum(f.stat().st_size for f in files) / 2**20
        dump = (run / "rollouts.jsonl").stat().st_size / 2**20
        blank = Path(tmp) / "blank.html"
        blank.write_text("<!doctype html><title>blank</title>")
        readies, walls, blanks = [], [], []
        for _ in range(args.repeats):
            ready, wall = open_in_chromium(index.as_uri())
            if ready is None:
                print(
                    "the page never finished its first render (no data-ready-ms)", file=sys.stderr
                )
                return 1
            readies.append(ready)
            walls.append(wall)
            blanks.append(open_in_chromium(blank.as_uri())[1])
    samples = args.groups * args.n
    print(f"run: {args.steps} steps x {args.groups} groups x {args.n} samples x "
          f"{args.tokens} tokens ({samples * args.steps} samples, dump {dump:.1f} MiB)")  # fmt: skip
    print(f"site: built in {built:.2f} s, {len(files)} data files, {size:.1f} MiB")
    print(f"page ready (manifest + curves + step list + last step rendered), median of "
          f"{args.repeats}: {statistics.median(readies):.0f} ms after navigation start "
          f"(min {min(readies):.0f}, max {max(readies):.0f})")  # fmt: skip
    print(f"chromium process: {statistics.median(walls):.2f} s with the page, "
          f"{statistics.median(blanks):.2f} s with an empty page")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
