"""`module:function` references in configs and flags (`reward.fn`, `agent.fn`, `env.grader`,
`rollouts eval --reward`), imported once, at the edge.

Where a module is looked for, in order: the current working directory, then the directory of
the config file that names it (when there is one), then the normal import path (installed
packages, PYTHONPATH). A user's `myreward.py` beside their config or in the folder they run
from is found without setting PYTHONPATH (the `rollouts` console script, unlike `python -m`,
does not put the working directory on the import path).

What it leaves behind: the module in `sys.modules`, and the one folder it was found in on
`sys.path` (a reward module's own imports of its sibling files, possibly lazy, need it); no
folder where nothing was found is added.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plumbing.errors import ConfigError


def resolve_callable(spec: str, *, config_dir: str | Path | None = None) -> Callable[..., Any]:
    """The function `spec` (`module:function`, `module` may be dotted) names.

    Args:
        config_dir: the directory of the config file the reference comes from, searched after
            the working directory.

    Raises:
        ConfigError: a malformed spec; a module found nowhere (the message lists where it
            looked and how to make it findable); a module that fails to import (its error);
            a module without that name, or a name that is not callable.
    """
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{spec!r}: expected 'module:function', e.g. 'myreward:reward_fn'")
    top = module.split(".")[0]
    looked = _search_dirs(config_dir)
    found = next((d for d in looked if _holds_module(d, top)), None)
    if found is not None and str(found) not in sys.path:
        sys.path.insert(0, str(found))
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name) and found is None:
            places = " or ".join(f"{what} ({d})" for d, what in looked.items())
            raise ConfigError(
                f"cannot resolve {spec!r}: no module {module!r} in the {places}, nor on the "
                f"import path (PYTHONPATH); put {top}.py in the working directory or next to "
                f"the config, or add its folder to PYTHONPATH"
            ) from err
        raise ConfigError(f"cannot resolve {spec!r}: importing {module} failed: {err}") from err
    except ImportError as err:
        raise ConfigError(f"cannot resolve {spec!r}: importing {module} failed: {err}") from err
    fn = getattr(mod, name, None)
    if fn is None:
        raise ConfigError(f"cannot resolve {spec!r}: module {module} ({mod.__file__}) has no "
                          f"{name!r}")  # fmt: skip
    if not callable(fn):
        raise ConfigError(f"cannot resolve {spec!r}: {module}.{name} is a "
                          f"{type(fn).__name__}, not a function")  # fmt: skip
    return fn


def _search_dirs(config_dir: str | Path | None) -> dict[Path, str]:
    """The folders searched first, in order, each with how the error names it."""
    dirs = {Path.cwd().resolve(): "working directory"}
    if config_dir is not None:
        dirs.setdefault(Path(config_dir).resolve(), "config file's directory")
    return dirs


def _holds_module(folder: Path, top: str) -> bool:
    """Whether `folder` holds the top-level module or package `top`."""
    return (folder / f"{top}.py").is_file() or (
        (folder / top).is_dir()
        and ((folder / top / "__init__.py").is_file() or importlib.util.find_spec(top) is None)
    )
