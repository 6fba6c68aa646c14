"""Recipes: a validated config → components → a loop. What `examples/` and the CLI call.

The top layer: nothing else in `training` imports from here.
"""
