"""`rollouts view --serve RUN_DIR`: the site of a live run, over HTTP on 127.0.0.1.

The page polls `data/manifest.js` every 2 s; each request for it first refreshes the site
(`ViewerSite.refresh`: only what the run appended since), so steps appear as they land. Files are
served from the site's folder only (the stdlib handler refuses paths outside it). Bound to
127.0.0.1 by default: the run's prompts and outputs are not for the network; pass --host to
choose otherwise.
"""

from __future__ import annotations

import functools
import http.server
import logging
import threading
from pathlib import Path

from plumbing.errors import RolloutsError
from training.viewer.site import ViewerSite

log = logging.getLogger("rollouts.viewer")


class _Handler(http.server.SimpleHTTPRequestHandler):
    site: ViewerSite
    lock: threading.Lock

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/data/manifest.js":
            with self.lock:  # one refresh at a time (requests run on threads)
                try:
                    self.site.refresh()
                except RolloutsError as err:  # a torn or bad line: serve the last good state
                    log.warning("viewer refresh failed: %s", err)
        super().do_GET()

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def make_server(run_dir: str | Path, out_dir: str | Path | None = None, *,
                host: str = "127.0.0.1", port: int = 0, mismatch: bool = False
                ) -> http.server.ThreadingHTTPServer:  # fmt: skip
    """The server of `run_dir`'s live site (not yet serving: call `serve_forever`); port 0 picks
    a free one (`server.server_address`)."""
    site = ViewerSite(run_dir, out_dir, live=True, mismatch=mismatch)
    site.refresh()
    handler = type("ViewerHandler", (_Handler,), {"site": site, "lock": threading.Lock()})
    bound = functools.partial(handler, directory=str(site.out_dir))
    return http.server.ThreadingHTTPServer((host, port), bound)
