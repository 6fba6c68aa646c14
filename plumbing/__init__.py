"""Plumbing every package uses: the error hierarchy, a nursery helper, the OpenMP set-up.

Why a package of its own, beside `rollouts`, `training` and `engines` rather than inside one of
them: all three need these, and a shared piece kept in a feature package makes every other
package import that one (before, `import engines` loaded all of `rollouts`, its rollout manager
and tools included, to get `EngineError`). This package imports none of the three, nor torch
or httpx; keep it small: only what every package needs goes here.

- `errors`: one base error, a few precise subclasses that also inherit the stdlib type they
  replace; users catch them from `rollouts.errors` / `rollouts`, which re-export them.
- `nursery`: `open_nursery()`, a trio nursery that raises a lone error as itself.
- `threads`: OpenMP spin settings applied on import, before torch loads.
- `gc_pause`: `gc_paused()`, the cyclic collector off while imports or a load build live objects.
- `model_paths`: `resolve_model_dir()`, what a model path means (model, run, checkpoints or
  checkpoint directory) for every command and the engines, which cannot import `training`.
"""
