"""One forward_backward per generated case (tests/shape_cases.py), at whatever world size this is
launched with; rank 0 writes each case's whole gradient, its logprobs (RL) or held-out loss
(SFT), its loss metrics and how its rows split into micro-batches on each rank; a "greedy"
case writes the greedy answers to its prompts (split across ranks under torchrun).
`tests/test_distributed_shapes.py` compares world 2 and 3 against world 1.

    python tests/distributed_shapes.py MODEL_DIR OUT_DIR CASES_JSON
    # OUT_DIR/<case>.safetensors, OUT_DIR/results.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from plumbing.gc_pause import gc_paused

with gc_paused(freeze=True):  # torch, transformers, the project: plumbing/gc_pause.py
    import torch
    import trio
    from safetensors.torch import save_file

    from rollouts.types import RolloutBatch, Sample
    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.config import BackendConfig, LoraSettings, OptimConfig
    from training.data.tokenize import TokenizedSample
    from training.distributed import current, run_rank0
    from training.distributed.split import rank_shares
    from training.rl.algorithms import grpo
    from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn


def rl_batch(case: dict[str, Any]) -> RolloutBatch:
    groups = tuple(
        tuple(Sample(tuple(g["prompt"]), tuple(resp), tuple(mask), group_id=k,
                     index_in_group=i).with_reward(reward)
              for i, (resp, mask, reward) in enumerate(
                  zip(g["responses"], g["masks"], g["rewards"], strict=True)))
        for k, g in enumerate(case["groups"])
    )  # fmt: skip
    return RolloutBatch(groups, 1, 0)


async def run_case(model_dir: str, tokenizer, case: dict[str, Any], out: Path) -> dict:
    ctx = current()
    world = ctx.world if ctx is not None else 1
    lora = LoraSettings(rank=4) if case["lora"] else None
    load = partial(load_model, model_dir, attention=case.get("attention", "sdpa"))
    common = dict(tokenizer=tokenizer, optim=OptimConfig(lr=1e-3, schedule="constant"),
                  max_steps=1, checkpoint_dir=out / "ckpt",
                  micro_batch_tokens=case["micro_batch_tokens"], lora=lora)  # fmt: skip
    extra: dict[str, torch.Tensor] = {}
    if case["kind"] == "greedy":  # held-out decoding: the prompts are split across ranks
        backend = PyTorchTrainingBackend(load, pack_length=None, **common)
        outputs = await backend.generate_greedy(case["prompts"], max_new_tokens=6,
                                                batch_size=case["batch_size"]).result()  # fmt: skip
        tensors = {f"greedy/{i}": torch.tensor(ids, dtype=torch.long)
                   for i, ids in enumerate(outputs)}  # fmt: skip
        save_file(tensors, str(out / f"{case['name']}.safetensors"))
        return {"name": case["name"], "seed": case["seed"], "n_outputs": len(outputs)}
    if case["kind"] == "rl":
        algorithm = grpo(loss=case["loss"], aggregation=case["aggregation"], max_tokens_norm=16,
                         mismatch=case.get("mismatch"))  # fmt: skip
        backend = PyTorchTrainingBackend(
            load, pack_length=None,
            collate_fn=partial(collate_rl, pad_id=tokenizer.pad_token_id), **common,
        )  # fmt: skip
        rows = build_examples(rl_batch(case), algorithm, share_prompts=case["share_prompts"])
        logprobs = await backend.compute_logprobs(rows).result()
        extra = {f"logprobs/{i}": lp for i, lp in enumerate(logprobs)}
        if "mismatch" in case:  # the engine's logprobs: the trainer's, offset by a known amount
            offsets = map(torch.tensor, case["engine_offsets"])
            rows = [replace(r, rollout_logprobs=tuple((lp + next(offsets)).tolist()))
                    for r, lp in zip(rows, logprobs, strict=True)]  # fmt: skip
        metrics = await backend.forward_backward(
            rows, loss_fn=rl_loss_fn(algorithm), loss_weight_fn=loss_weight_fn(algorithm)
        ).result()
    else:
        backend = PyTorchTrainingBackend(load, pack_length=case["pack_length"], **common)
        rows = [TokenizedSample(tuple(s["ids"]), tuple(s["mask"]), f"s{i}")
                for i, s in enumerate(case["samples"])]  # fmt: skip
        metrics = await backend.forward_backward(rows).result()
        metrics["eval_loss"] = (await backend.forward(rows).result())["loss"]
    grads = await backend.full_grads().result()
    shares = rank_shares(rows, world, packed=backend.pack_length is not None)
    mb_counts = [len(backend.split_microbatches([rows[i] for i in s])) for s in shares]
    tensors = {f"grad/{k}": v for k, v in grads.items()} | extra
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / f"{case['name']}.safetensors")
    )
    return {"name": case["name"], "seed": case["seed"], "mb_counts": mb_counts,
            "metrics": metrics}  # fmt: skip


async def all_cases(model_dir: str, out: Path, cases: list[dict[str, Any]]) -> None:
    tokenizer = load_tokenizer(model_dir)
    results = [await run_case(model_dir, tokenizer, case, out) for case in cases]
    (out / "results.json").write_text(json.dumps(results))


def main() -> int:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    cases = json.loads(Path(sys.argv[3]).read_text())
    out.mkdir(parents=True, exist_ok=True)
    run_rank0(BackendConfig(num_threads=1), lambda: trio.run(all_cases, model_dir, out, cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
