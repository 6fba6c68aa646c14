"""Recipes: a validated config → components → a loop. What `examples/` and the CLI call.

The top layer (`train_rl` is the one-call quick start; `cli` is the `rollouts` command): nothing else in `training` imports from here.
"""

from typing import TYPE_CHECKING

from plumbing.lazy import lazy_exports

if TYPE_CHECKING:  # the exports, loaded on first use (plumbing/lazy.py)
    from training.recipes.quick import quick_rl_config as quick_rl_config
    from training.recipes.quick import train_rl as train_rl
    from training.recipes.rl import RLExtensions as RLExtensions
    from training.recipes.rl import RLSummary as RLSummary
    from training.recipes.rl import run_rl_recipe as run_rl_recipe
    from training.recipes.rl_models import rl_backend as rl_backend
    from training.recipes.sft import SFTSummary as SFTSummary
    from training.recipes.sft import run_sft_recipe as run_sft_recipe

__getattr__, __all__ = lazy_exports(__name__, __file__)
