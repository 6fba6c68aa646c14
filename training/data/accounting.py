"""What tokenization did to each record it cut or dropped, one `DataIssue` per record.

`tokenize_records` returns every one of them in its `TokenizeStats.issues`, so nothing leaves the
training data without a record of where it came from (file:line), how long it was, the limit it
met and what happened to it. `issues_warning` is the one log line that names the first few;
`write_data_report` writes all of them as JSONL (the recipe's `data.report_path`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

What = Literal["cut", "dropped over-long", "no trained tokens left"]


@dataclass(frozen=True)
class DataIssue:
    """One record cut or dropped by `tokenize_records`.

    `what`: "cut" (kept, its last `tokens_cut` tokens removed), "dropped over-long"
    (`data.overlong: drop`), or "no trained tokens left" (dropped: the cut, when `tokens_cut`
    > 0, removed every trained token, or the template rendered none).
    """

    source: str  # "path:line"
    tokens: int  # the whole record, before any cut
    limit: int  # the max_seq_len it met
    what: What
    tokens_cut: int  # tokens beyond the limit (0: the record was not over-long)

    def describe(self) -> str:
        """E.g. `a.jsonl:3 (tokens 1500, limit 1024: cut by 476 tokens)`."""
        if self.what == "cut":
            happened = f"cut by {self.tokens_cut} tokens"
        elif self.what == "dropped over-long":
            happened = "dropped over-long"
        elif self.tokens_cut:
            happened = f"cut by {self.tokens_cut} tokens, no trained tokens left: dropped"
        else:
            happened = "no trained tokens: dropped"
        return f"{self.source} (tokens {self.tokens}, limit {self.limit}: {happened})"


SHOWN = 5  # issues named in the warning; the report file has them all


def issues_warning(issues: Sequence[DataIssue], n_records: int, fix: str,
                   report: Path | str | None) -> str | None:  # fmt: skip
    """The warning naming how many records were cut or dropped and the first `SHOWN`; None: none.

    Args:
        issues: every record cut or dropped (of all splits).
        n_records: how many records the splits had.
        fix: what to do about over-long records (e.g. "raise data.max_seq_len ...").
        report: the file that lists every issue, named in the line.
    """
    if not issues:
        return None
    cut = sum(i.what == "cut" for i in issues)
    dropped = len(issues) - cut
    first = "; ".join(i.describe() for i in issues[:SHOWN])
    more = f"; and {len(issues) - SHOWN} more" if len(issues) > SHOWN else ""
    where = f" (all of them: {report})" if report is not None else ""
    advice = f"; {fix}" if any(i.tokens_cut for i in issues) else ""
    return (
        f"{len(issues)} of {n_records} records were cut or dropped ({cut} cut, {dropped} "
        f"dropped){where}: {first}{more}{advice}"
    )


def write_data_report(path: Path | str, issues: Sequence[DataIssue]) -> Path:
    """Write one JSON object per issue (an empty file when there is none); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps(asdict(issue)) + "\n" for issue in issues)
    path.write_text("".join(lines), encoding="utf-8")
    return path
