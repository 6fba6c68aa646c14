"""`rollouts view RUN_DIR [--out DIR] [--serve [--host H] [--port N]] [--mismatch]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from plumbing.errors import RolloutsError


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Write (or serve) the viewer site of a run directory; the exit code (0, or 1 on error)."""
    parser = argparse.ArgumentParser(prog=prog, description=(
        "A static site of a run directory: each step's groups, prompts, responses coloured by "
        "logprob, rewards, advantages, failures, tool calls; the run's curves; the same "
        "prompt across steps; SFT held-out generations. Open RUN_DIR/viewer/index.html."))  # fmt: skip
    parser.add_argument("run_dir", help="the run's output directory (output_dir)")
    parser.add_argument("--out", default=None, help="where the site goes (default RUN_DIR/viewer)")
    parser.add_argument("--serve", action="store_true",
                        help="serve it over HTTP and refresh it as the run writes steps")  # fmt: skip
    parser.add_argument("--mismatch", action="store_true",
                        help="also score each sample with the trainer's weights of its version "
                        "(its checkpoint) to colour engine/trainer logprob mismatch per token; "
                        "one forward pass per sample")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="--serve: address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="--serve: port (default 8765)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir} is not a directory; give a run's output_dir (it holds "
              "metrics.jsonl, and rollouts.jsonl with train.dump_rollouts=true)", file=sys.stderr)  # fmt: skip
        return 1
    try:
        if args.serve:
            return _serve(run_dir, args)
        from training.viewer.site import ViewerSite

        site = ViewerSite(run_dir, args.out, mismatch=args.mismatch)
        site.refresh()
    except (RolloutsError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    index = (site.out_dir / "index.html").resolve()
    print(f"wrote {index} ({len(site.steps)} steps); open file://{index}")
    return 0


def _serve(run_dir: Path, args: argparse.Namespace) -> int:
    from training.viewer.serve import make_server

    server = make_server(run_dir, args.out, host=args.host, port=args.port,
                         mismatch=args.mismatch)  # fmt: skip
    host, port = server.server_address[:2]
    print(f"serving {run_dir} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
