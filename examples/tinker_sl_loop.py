"""Supervised fine-tuning written only against the `tinker` SDK (the shape of tinker-cookbook's
sl_loop.py), run on this machine by `rollouts tinker-serve`.

    # the example starts the server itself (the tiny model on CPU, built on first use):
    python examples/tinker_sl_loop.py
    # or start the server yourself and point the unchanged program at it:
    rollouts tinker-serve --model runs/tiny_model --port 8000 &
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local \\
        python examples/tinker_sl_loop.py --base-model runs/tiny_model

The task: complete "a+b=" with the sum (synthetic, no download). Prints the mean NLL per
completion token each step; the last line is a one-line summary.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinker_local import tinker_server  # only starts a server when none is given


def problems(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 49), rng.randint(0, 49)) for _ in range(n)]
    return [(f"{a}+{b}=", f"{a + b}\n") for a, b in pairs]


def to_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """Train on the answer only: weights 0 on the prompt's targets, 1 on the answer's."""
    p, a = tokenizer.encode(prompt), tokenizer.encode(answer)
    tokens = p + a + [tokenizer.eos_token_id]
    weights = [0.0] * (len(p) - 1) + [1.0] * (len(a) + 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})  # fmt: skip


def main(args: argparse.Namespace, base_url: str) -> None:
    service_client = tinker.ServiceClient(base_url=base_url,
                                          api_key=os.environ.get("TINKER_API_KEY", "tml-local"))  # fmt: skip
    training_client = service_client.create_lora_training_client(
        base_model=args.base_model, rank=args.lora_rank).result()  # fmt: skip
    tokenizer = training_client.get_tokenizer()
    data = problems(args.batch_size * args.steps, seed=0)
    nlls = []
    for step in range(args.steps):
        lr = args.learning_rate * (1.0 - step / args.steps)  # linear decay, as sl_loop.py
        batch = [to_datum(tokenizer, *pq) for pq in
                 data[step * args.batch_size : (step + 1) * args.batch_size]]  # fmt: skip
        fwd_bwd = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim = training_client.optim_step(types.AdamParams(learning_rate=lr, eps=1e-8))
        result, _ = fwd_bwd.result(), optim.result()
        n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        nll = result.metrics["loss:sum"] / n_tokens
        nlls.append(nll)
        print(f"step {step:3d}  lr {lr:.2e}  train_mean_nll {nll:.4f}", flush=True)
    state = training_client.save_state("final").result().path
    sampler = training_client.save_weights_and_get_sampling_client().result()
    prompt, answer = problems(1, seed=1)[0]
    out = sampler.sample(types.ModelInput.from_ints(tokenizer.encode(prompt)), 1,
                         types.SamplingParams(max_tokens=4, temperature=0.0)).result()  # fmt: skip
    said = tokenizer.decode(out.sequences[0].tokens)
    print(f"sample: {prompt}{said!r} (want {answer!r})")
    print(f"summary: steps={args.steps} nll {nlls[0]:.3f} -> {nlls[-1]:.3f} state={state}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running server (or TINKER_BASE_URL)")
    parser.add_argument("--model", default="runs/tiny_model",
                        help="model directory for the server this example starts")  # fmt: skip
    parser.add_argument("--base-model", default=None, help="base_model name (default: --model)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--run-dir", default="runs/tinker")
    args = parser.parse_args()
    args.base_model = args.base_model or args.model
    with tinker_server(args.base_url, args.model, args.run_dir) as url:
        main(args, url)
