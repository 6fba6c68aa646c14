"""Package exports loaded on first use: `from training import X` without importing torch for
`rollouts --help`.

Why: `training/__init__.py` names ~70 things from every layer, and importing them all loads
torch and transformers (~2.5 s of CPU). Commands that never train — `--help`, a config error, an
unknown command, `rollouts plot` — paid that on every call, and so did every test that runs one.

How: the package lists its exports as ordinary `from M import X as X` lines under
`if TYPE_CHECKING:` (so editors and type checkers see them), and `lazy_exports(__name__, __file__)`
reads those lines back (a parse of one small file, ~1 ms) into a module `__getattr__` that
imports `M` when `X` is first asked for. One list, no second copy to keep in step.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plumbing.gc_pause import gc_paused


def lazy_exports(package: str, init_file: str) -> tuple[Callable[[str], Any], list[str]]:
    """(`__getattr__`, `__all__`) for the package whose `__init__.py` is `init_file`: every
    `from M import X as X` under its `if TYPE_CHECKING:` block becomes an attribute loaded on
    first access (and then cached in the package's namespace)."""
    where: dict[str, str] = {}
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    for alias in stmt.names:
                        where[alias.asname or alias.name] = stmt.module
    module = importlib.import_module(package)

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        with gc_paused():  # the first use imports torch and more: plumbing/gc_pause.py
            value = getattr(importlib.import_module(where[name]), name)
        setattr(module, name, value)
        return value

    return __getattr__, sorted(where)
