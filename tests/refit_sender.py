"""A trainer's side of one distributed weight push to one engine, as a program of its own (a
trainer and an engine cannot join one group from one process): `RefitGroup` forms the group,
`receive_on_engines` drives the engine's routes, the weights of MODEL_DIR go out bucket by
bucket.

    python tests/refit_sender.py URL MODEL_DIR VERSION [DIE_AFTER]

Prints the failures `receive_on_engines` reports, as JSON. With DIE_AFTER the program dies
(`os._exit(9)`, as a SIGKILL would: no clean-up, no `/end_weight_update`) once that many buckets
went out, while the engine waits for the next one.
"""

from __future__ import annotations

import json
import os
import sys

import trio
from transformers import AutoModelForCausalLM

from engines import SGLangEngine
from engines.refit import RefitGroup, receive_on_engines
from training.backend.weight_buckets import gathered_buckets, plan_buckets

KILLED = 9


async def main(url: str, model_dir: str, version: str, die_after: int | None) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    group = RefitGroup(timeout_s=20, bucket_mb=0.05)  # several buckets a push
    plan = plan_buckets(model, group.bucket_bytes)
    assert die_after is None or 0 < die_after < len(plan), (die_after, len(plan))
    failures: dict = {}
    async with SGLangEngine(url, max_retries=0) as engine:
        if await group.ensure([engine]) != [engine]:
            sys.exit("the engine did not join the weight-update group")
        group.start_push()
        async with trio.open_nursery() as nursery:

            async def engine_side() -> None:
                failures.update(await receive_on_engines(group, [engine], plan, version))

            nursery.start_soon(engine_side)
            for i, tensors in enumerate(gathered_buckets(model, plan)):
                if i == die_after:
                    await trio.sleep(0.5)  # the engine's call for this bucket is under way
                    os._exit(KILLED)
                await trio.to_thread.run_sync(group.send, tensors)
        await group.close([engine])
    print(json.dumps(failures))


if __name__ == "__main__":
    url, model_dir, version, *rest = sys.argv[1:]
    trio.run(main, url, model_dir, version, int(rest[0]) if rest else None)
