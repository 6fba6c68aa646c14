"""The launchers a run accepts: plain `python`, `torchrun`, and the `accelerate launch` that is one.

rollouts runs as one process, or as a torchrun job: every process has torchrun's variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; training/distributed/context.py).
`accelerate launch --multi_gpu --num_processes N` starts its processes with torchrun's own
launcher (torch.distributed.run), so they get exactly those variables and run as a torchrun job
does (2 CPU ranks over gloo, accelerate 1.15: docs/gpus.md). Every other `accelerate launch` is
refused before anything loads, with the torchrun command that does what was asked:

- accelerate's one-process launcher (no `--multi_gpu`; `--cpu`; `--num_processes N` on a machine
  without GPUs, where multi-CPU means MPI): one process without RANK or WORLD_SIZE, so the N
  processes asked for would silently be one;
- DeepSpeed or Megatron-LM: rollouts shards with its own FSDP2;
- `--mixed_precision` or `--dynamo_backend` other than no: rollouts reads none of accelerate's
  settings, and would train in `model.dtype`, uncompiled, without saying so.

Torch-free: the check runs before the config is even read.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence

from plumbing.errors import ConfigError

# Set by every path of `accelerate launch` (accelerate/utils/launch.py: the simple, multi-GPU
# and DeepSpeed launchers all write it), and by nothing else.
ACCELERATE_MARKER = "ACCELERATE_MIXED_PRECISION"
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launcher(environ: Mapping[str, str], argv: Sequence[str]) -> None:
    """Refuse an `accelerate launch` that is not a torchrun job, naming the command to use.

    Args:
        environ: this process's environment (`os.environ`).
        argv: this process's command line (`sys.argv`), to write the torchrun equivalent.

    Raises:
        ConfigError: launched by `accelerate launch` in a way rollouts cannot run as asked.
    """
    if ACCELERATE_MARKER not in environ:
        return
    unread = [
        (environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true",
         "DeepSpeed (rollouts shards with FSDP2 under torchrun: backend.fsdp)"),
        (environ.get("ACCELERATE_USE_MEGATRON_LM", "").lower() == "true",
         "Megatron-LM (rollouts shards with FSDP2 under torchrun: backend.fsdp)"),
        (environ[ACCELERATE_MARKER].lower() != "no",
         f"--mixed_precision {environ[ACCELERATE_MARKER]} (rollouts reads model.dtype, and "
         "backend.fsdp.param_dtype under torchrun)"),
        (environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() != "NO",
         f"--dynamo_backend {environ.get('ACCELERATE_DYNAMO_BACKEND')} (rollouts does not "
         "compile the model)"),
    ]  # fmt: skip
    asked = [what for bad, what in unread if bad]
    one_process = any(k not in environ for k in TORCHRUN_VARS)
    if not asked and not one_process:
        return  # `accelerate launch --multi_gpu`: torchrun's launcher and variables
    if one_process:
        cause = (
            "accelerate launch started this as one process without torchrun's variables "
            f"({', '.join(k for k in TORCHRUN_VARS if k not in environ)} unset): only "
            "`accelerate launch --multi_gpu` starts a torchrun job, the one multi-process "
            "launch rollouts joins"
        )
        n = "N"
    else:
        cause = "accelerate launch was asked for what rollouts does not read: " + "; ".join(asked)
        n = environ.get("LOCAL_WORLD_SIZE") or environ["WORLD_SIZE"]
    torchrun, plain = commands(argv, n, environ)
    raise ConfigError(
        f"{cause}. Run `{torchrun}` instead ({n} processes; `{plain}` for one), or `accelerate "
        f"launch --multi_gpu --num_processes {n} --mixed_precision no ...` (docs/gpus.md)"
    )


def commands(argv: Sequence[str], nproc: str, environ: Mapping[str, str]) -> tuple[str, str]:
    """This program with `argv`'s arguments under torchrun, and as one plain process."""
    program, *args = argv
    if program.endswith(".py"):
        plain, tail = ["python", program, *args], [program, *args]
    else:  # a console script, e.g. `rollouts sft ...`
        plain = [os.path.basename(program), *args]
        tail = ["--no-python", *plain]
    nodes = environ.get("GROUP_WORLD_SIZE", "1")
    where = ["--standalone"]
    if nodes != "1":  # the node's part of a multi-node job, pinned as accelerate pinned it
        where = ["--nnodes", nodes, "--node_rank", environ.get("GROUP_RANK", "0"),
                 "--master_addr", environ.get("MASTER_ADDR", "HOST"),
                 "--master_port", environ.get("MASTER_PORT", "29500")]  # fmt: skip
    return shlex.join(["torchrun", *where, "--nproc_per_node", nproc, *tail]), shlex.join(plain)
