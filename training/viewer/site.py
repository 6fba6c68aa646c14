"""`rollouts view RUN_DIR`: a static site of a run, refreshed in place as steps land.

The site is `index.html` (the page: CSS and JS inlined, no network) and `data/*.js`: one file
per step (`step_000012.js`), a manifest (steps with their counts, the metrics as columns) and
the SFT evaluations. Each data file is a script that hands its payload to `RV_DATA(kind,
payload)`, so the page loads them with <script> tags, on demand, from a file:// URL too
(browsers block fetch() of file://). JSON is valid JS; the page renders every text with
textContent, never as HTML (model output is untrusted).

`ViewerSite.refresh()` reads only what was appended to the dump since the last call, writes the
new steps' files, and rewrites the manifest when anything changed; `--serve` calls it as the
page polls.
"""

from __future__ import annotations

import json
import os
import time
from importlib import resources
from pathlib import Path
from typing import Any

from training.viewer.context import advantage_rule, load_decoder, load_run_config
from training.viewer.run_data import (
    DUMP,
    iter_new_dump_lines,
    read_metric_rows,
    read_sft_evals,
    step_summary,
    step_view,
    token_decoder,
)

ASSETS = ("viewer.html", "viewer.css", "viewer.js")


def page_html(title: str) -> str:
    """index.html: the template with the stylesheet and the script inlined."""
    static = resources.files("training.viewer") / "static"
    html, css, js = (static.joinpath(name).read_text(encoding="utf-8") for name in ASSETS)
    safe_title = title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (html.replace("{{TITLE}}", safe_title).replace("/*{{CSS}}*/", css)
            .replace("/*{{JS}}*/", js))  # fmt: skip


def write_data_js(path: Path, kind: str, payload: Any) -> None:
    """`RV_DATA(kind, payload);` written whole, then renamed: a polling page never reads half."""
    text = f"RV_DATA({json.dumps(kind)}, {json.dumps(payload, ensure_ascii=False)});\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def metric_columns(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Metrics rows as columns (one list per metric, None where a row lacks it): compact."""
    keys = sorted({k for r in rows for k in r if k != "step"})
    return {"steps": [r["step"] for r in rows],
            "cols": {k: [r.get(k) for r in rows] for k in keys}}  # fmt: skip


class ViewerSite:
    """The site of one run directory in `out_dir` (default RUN_DIR/viewer); see the module doc.

    Args:
        run_dir: the run's output directory.
        out_dir: where the site goes.
        live: the page polls the manifest (set by `--serve`).
        mismatch: score every sample with the trainer's weights of its version too
            (training/viewer/mismatch.py), for the engine/trainer mismatch colouring.
    """

    def __init__(self, run_dir: str | Path, out_dir: str | Path | None = None, *,
                 live: bool = False, mismatch: bool = False):  # fmt: skip
        self.run_dir = Path(run_dir)
        self.out_dir = Path(out_dir) if out_dir is not None else self.run_dir / "viewer"
        self.data_dir = self.out_dir / "data"
        self.live = live
        self.mismatch = mismatch
        self._trainer = None
        self._offset = 0
        self._summaries: dict[int, dict[str, Any]] = {}
        self._config = None
        self._decode = None
        self._advantages = None
        self._token = token_decoder(None)
        self._signature: tuple = ()
        self._ready = False

    @property
    def steps(self) -> list[int]:
        """The steps written so far."""
        return sorted(self._summaries)

    def _prepare(self) -> None:
        """The run's config, tokenizer and advantage rule, once (the checkpoint that has the
        tokenizer may land after a live run's first steps: looked for again until found)."""
        if self._config is None:
            self._config = load_run_config(self.run_dir)
            self._advantages = advantage_rule(self._config)
            if self.mismatch:
                from training.viewer.mismatch import TrainerLogprobs

                self._trainer = TrainerLogprobs(self.run_dir, self._config)
        if self._decode is None:
            self._decode = load_decoder(self.run_dir, self._config)
            if self._decode is not None:
                self._token = token_decoder(self._decode)
        if not self._ready:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            title = f"rollouts view: {self.run_dir.resolve().name}"
            (self.out_dir / "index.html").write_text(page_html(title), encoding="utf-8")
            self._ready = True

    def refresh(self) -> bool:
        """Write what the run added since the last call; True when anything changed.

        Raises:
            DataError: the dump has a malformed line (names the file and where).
        """
        self._prepare()
        changed = False
        dump = self.run_dir / DUMP
        if dump.is_file():
            if dump.stat().st_size < self._offset:  # the run started over (resume=never)
                self._offset, self._summaries, changed = 0, {}, True
            for end, step, record in iter_new_dump_lines(dump, self._offset):
                if self._trainer is not None and "trainer_logprobs" not in record:
                    record["trainer_logprobs"] = self._trainer(record)
                view = step_view(step, record, self._decode, self._advantages, self._token)
                write_data_js(self.data_dir / f"step_{step:06d}.js", "step", view)
                self._summaries[step] = step_summary(view)
                self._offset, changed = end, True
        signature = tuple(_stat(self.run_dir / name) for name in ("metrics.jsonl",
                                                                     "eval_generations.jsonl"))  # fmt: skip
        if changed or signature != self._signature or not (self.data_dir / "manifest.js").exists():
            self._signature = signature
            self._write_manifest()
            changed = True
        return changed

    def _write_manifest(self) -> None:
        sft = read_sft_evals(self.run_dir)
        if sft:
            write_data_js(self.data_dir / "sft_evals.js", "sft", sft)
        manifest = {
            "run": str(self.run_dir.resolve()), "name": self.run_dir.resolve().name,
            "generated": time.strftime("%Y-%m-%d %H:%M:%S"), "live": self.live,
            "steps": [self._summaries[s] for s in sorted(self._summaries)],
            "metrics": metric_columns(read_metric_rows(self.run_dir)),
            "sft_evals": len(sft), "tokenizer": self._decode is not None,
            "advantages": self._advantages is not None, "mismatch": self.mismatch,
        }  # fmt: skip
        write_data_js(self.data_dir / "manifest.js", "manifest", manifest)


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return (0, 0)
    return (st.st_size, st.st_mtime_ns)


def build_site(run_dir: str | Path, out_dir: str | Path | None = None, *,
               mismatch: bool = False) -> Path:  # fmt: skip
    """Write the static site of `run_dir` and return its index.html.

    Raises:
        DataError: the run's rollout dump has a malformed line.
    """
    site = ViewerSite(run_dir, out_dir, mismatch=mismatch)
    site.refresh()
    return site.out_dir / "index.html"
