"""The run viewer: `rollouts view RUN_DIR` writes a static site of a run directory.

Layers: `run_data` reads the run's files into JSON-ready dicts (no torch); `context` finds the
run's tokenizer and advantage rule; `site` writes the page and its per-step data files and
refreshes them as the run grows; `serve` serves a live run's site on 127.0.0.1; `cli` is the
command. The page itself is `static/` (HTML, CSS, JS inlined into one index.html).
"""

from training.viewer.site import ViewerSite as ViewerSite
from training.viewer.site import build_site as build_site
