"""`rollouts launch --config RL.yaml --cluster CLUSTER.yaml [--out DIR] [--submit [--wait]]`.

Writes `job.sbatch` (Slurm) and `k8s.yaml` (Kubernetes: Services and StatefulSets) for the RL
config on the cluster described (training/launch/spec.py); `--submit` runs `sbatch` on the
script and prints the job id (`--wait`: until the job ends; its exit code is ours). Both files
are checked before they are written: the script with `bash -n`, the manifests with
training/launch/k8s_schema.py. docs/cluster.md describes them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from plumbing.errors import ConfigError, RolloutsError

EXIT_ERROR = 2


def write_launch_files(rl_config: str, cluster: str, out: str | None,
                       overrides: Sequence[str] = ()) -> tuple[Path, Path]:  # fmt: skip
    """Validate both configs and write `job.sbatch` and `k8s.yaml` into `out` (default:
    `run_dir/launch`). Returns their paths.

    Raises:
        ConfigError: a bad RL config or cluster description (named), no model to serve, or a
            generated file that fails its check (a launcher bug; the message shows it).
    """
    from training.config import load_config
    from training.launch.k8s import dump_manifests, render_manifests
    from training.launch.k8s_schema import validate_manifests
    from training.launch.slurm import config_engine_args, render_sbatch
    from training.launch.spec import load_cluster
    from training.rl_config import RLRunConfig

    spec = load_cluster(cluster)
    config = load_config(RLRunConfig, rl_config, list(overrides))
    model = spec.inference.model or config.model.path
    if not model:
        raise ConfigError(f"{cluster}: inference.model: the engines need a model and "
                          f"{rl_config} has no model.path: give inference.model (a directory "
                          "on the shared filesystem, or an HF id)")  # fmt: skip
    if os.path.exists(model):
        model = os.path.abspath(model)
    config_path = os.path.abspath(rl_config)
    workdir = spec.workdir or os.getcwd()
    engine_args = config_engine_args(config, spec.inference.engine)
    script = render_sbatch(spec, rl_config=config_path, model=model, workdir=workdir,
                           overrides=overrides, config_args=engine_args)  # fmt: skip
    checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    if checked.returncode != 0:
        raise ConfigError(f"the generated batch script is not valid bash: {checked.stderr}")
    manifests = render_manifests(spec, rl_config=config_path, model=model, overrides=overrides,
                                 config_args=engine_args)  # fmt: skip
    problems = validate_manifests(manifests)
    if problems:
        raise ConfigError("the generated manifests fail the schema check:\n  "
                          + "\n  ".join(problems))  # fmt: skip
    folder = Path(out or Path(spec.run_dir) / "launch")
    folder.mkdir(parents=True, exist_ok=True)
    (Path(spec.run_dir) / "logs").mkdir(parents=True, exist_ok=True)
    job, k8s = folder / "job.sbatch", folder / "k8s.yaml"
    job.write_text(script)
    job.chmod(0o755)
    k8s.write_text(dump_manifests(manifests))
    return job, k8s


def launch_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts launch`: returns 0, 2 after `error: ...`, or the submitted job's exit code."""
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Write a Slurm batch script and Kubernetes manifests that run an RL config on a "
        "cluster: engines on their nodes first, then torchrun on the trainer nodes."))  # fmt: skip
    parser.add_argument("--config", required=True, help="the RL config (YAML)")
    parser.add_argument("--cluster", required=True, help="cluster description (docs/cluster.md)")
    parser.add_argument("--out", default=None, help="where the files go (default: RUN_DIR/launch)")
    parser.add_argument("--submit", action="store_true", help="sbatch the script")
    parser.add_argument("--wait", action="store_true",
                        help="with --submit: until the job ends (sbatch --wait)")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted overrides for the RL config")
    args = parser.parse_intermixed_args(argv)
    if args.wait and not args.submit:
        parser.error("--wait waits for a submitted job: add --submit")
    try:
        job, k8s = write_launch_files(args.config, args.cluster, args.out, args.overrides)
    except RolloutsError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {job}\nwrote {k8s} (kubectl apply -f {k8s})")
    if not args.submit:
        print(f"submit with: sbatch {job}")
        return 0
    command = ["sbatch", "--parsable", *(["--wait"] if args.wait else []), str(job)]
    try:
        done = subprocess.run(command, text=True, stdout=subprocess.PIPE)
    except FileNotFoundError:
        print("error: sbatch not found: run on a Slurm login node, or submit the script "
              "there yourself", file=sys.stderr)  # fmt: skip
        return EXIT_ERROR
    job_id = done.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}" + (f"; it ended with exit code {done.returncode}"
                                       if args.wait else ""))  # fmt: skip
    return done.returncode
