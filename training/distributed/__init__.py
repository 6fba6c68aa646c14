"""Training past one process: FSDP2 (`fully_shard`) ranks under torchrun, driven from rank 0.

One code path, any world size. Plain `python` is world size 1: no process group, nothing here
is active and the backend runs its operations directly. Under `torchrun`:

- every rank builds the same backends and holds their models sharded with `fully_shard` (each
  decoder layer, then the root) and an optimizer over the sharded (DTensor) parameters;
- the trio loop (DataBuffer, AsyncRolloutManager, engines, loggers) runs on rank 0 only. Each
  backend operation rank 0 queues is sent to the other ranks by rank 0's one trainer thread —
  a broadcast command header, then each rank's rows (token-balanced) — and every rank runs it,
  so collectives are issued in one order everywhere;
- ranks ≥ 1 run `serve_commands`, a loop that receives and runs those operations until rank 0
  says stop.

Modules: `context` (process groups, device, sharding), `wire` (the command channel: a JSON
codec, no pickle), `split` (rows → ranks), `worker` (the loop of ranks ≥ 1).
"""

from training.distributed.context import DistContext as DistContext
from training.distributed.context import current as current
from training.distributed.context import init_distributed as init_distributed
from training.distributed.context import is_worker_rank as is_worker_rank
from training.distributed.worker import run_rank0 as run_rank0
from training.distributed.worker import serve_commands as serve_commands
