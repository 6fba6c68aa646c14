"""RL written only against the `tinker` SDK (the shape of tinker-cookbook's rl_loop.py:
sample a group per prompt, center the rewards, importance_sampling, optim_step), run on this
machine by `rollouts tinker-serve`.

    # the example starts the server itself (the tiny model on CPU, built on first use):
    python examples/tinker_rl_loop.py
    # or start the server yourself and point the unchanged program at it:
    rollouts tinker-serve --model runs/tiny_model --port 8000 &
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local \\
        python examples/tinker_rl_loop.py --base-model runs/tiny_model

The task (no download, learnable by a random tiny model): answer "a+b=" with digits; the
reward is the fraction of the sampled tokens that are digits. Prints the mean reward per
step; the last line is a one-line summary.
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


def reward(tokenizer, tokens: list[int]) -> float:
    return sum(tokenizer.decode([t]).strip().isdigit() for t in tokens) / max(1, len(tokens))


def main(args: argparse.Namespace, base_url: str) -> None:
    service_client = tinker.ServiceClient(base_url=base_url,
                                          api_key=os.environ.get("TINKER_API_KEY", "tml-local"))  # fmt: skip
    training_client = service_client.create_lora_training_client(
        base_model=args.base_model, rank=args.lora_rank).result()  # fmt: skip
    tokenizer = training_client.get_tokenizer()
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    adam = types.AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    rng = random.Random(0)
    means = []
    for step in range(args.steps):
        sampling_client = training_client.save_weights_and_get_sampling_client().result()
        prompts = [types.ModelInput.from_ints(tokenizer.encode(
            f"{rng.randint(0, 49)}+{rng.randint(0, 49)}=")) for _ in range(args.batch_size)]  # fmt: skip
        futures = [sampling_client.sample(prompt=p, num_samples=args.group_size,
                                          sampling_params=params) for p in prompts]  # fmt: skip
        datums, rewards = [], []
        for prompt, future in zip(prompts, futures, strict=True):
            sequences = future.result().sequences
            group = [reward(tokenizer, s.tokens) for s in sequences]
            rewards += group
            mean = sum(group) / len(group)
            for seq, r in zip(sequences, group, strict=True):
                if r == mean:
                    continue  # no signal in this sample
                ob = prompt.length - 1
                tokens = list(seq.tokens)
                model_input = prompt.append(types.EncodedTextChunk(tokens=tokens[:-1]))
                datums.append(types.Datum(model_input=model_input, loss_fn_inputs={
                    "target_tokens": [0] * ob + tokens,
                    "logprobs": [0.0] * ob + list(seq.logprobs),
                    "advantages": [0.0] * ob + [r - mean] * len(tokens)}))  # fmt: skip
        means.append(sum(rewards) / len(rewards))
        if datums:
            fwd_bwd = training_client.forward_backward(datums, loss_fn=args.loss_fn)
            optim = training_client.optim_step(adam)
            fwd_bwd.result(), optim.result()
        print(f"step {step:3d}  reward {means[-1]:.3f}  datums {len(datums)}", flush=True)
    path = training_client.save_state("final").result().path
    print(f"summary: steps={args.steps} reward {means[0]:.3f} -> {means[-1]:.3f} "
          f"(mean of the last 3: {sum(means[-3:]) / len(means[-3:]):.3f}) state={path}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running server (or TINKER_BASE_URL)")
    parser.add_argument("--model", default="runs/tiny_model",
                        help="model directory for the server this example starts")  # fmt: skip
    parser.add_argument("--base-model", default=None, help="base_model name (default: --model)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=5e-2)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--loss-fn", default="importance_sampling",
                        choices=["importance_sampling", "ppo", "cispo"])  # fmt: skip
    parser.add_argument("--run-dir", default="runs/tinker")
    args = parser.parse_args()
    args.base_model = args.base_model or args.model
    with tinker_server(args.base_url, args.model, args.run_dir) as url:
        main(args, url)
