"""Tinker's built-in losses on one datum's per-token target logprobs, as Tinker documents
them (https://tinker-docs.thinkingmachines.ai/losses): every loss is a SUM over tokens (and
over the datums of a call), not a mean, and returns the per-token `elementwise_loss`.

- cross_entropy: -logp * weights (weights default to 1)
- importance_sampling: -(exp(logp - q) * A)
- ppo: -min(r * A, clip(r, low, high) * A), clip thresholds from `loss_fn_config`
  (`clip_low_threshold` 0.8, `clip_high_threshold` 1.2 by default)
- cispo: -(sg(clip(r, low, high)) * logp * A), thresholds 0.0 / 4.0 by default
- gspo (GSPO-token, https://tinker-docs.thinkingmachines.ai/tinker/losses/gspo): the sequence
  ratio s = exp(mean of (logp - q) over the tokens `sequence_ratio_mask` marks); every token's
  ratio r_t = sg(s) * exp(logp - sg(logp)) (s's value, its own logprob's gradient);
  -min(r_t * A, clip(r_t, low, high) * A)
- dro: -(logp * A - beta / 2 * (logp - q)^2)

where q are the sampler's `logprobs`, A the `advantages` and r = exp(logp - q). Tinker's docs
give no default for gspo's thresholds nor dro's `beta`: those must be in `loss_fn_config`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rollouts.tinker_server.wire import Datum, TinkerRequestError

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict], torch.Tensor]
REFUSED = {
    "stable_reinforce": "its definition is not public (Thinking Machines have not documented "
                        "it); use importance_sampling, ppo or cispo",
    "custom": "server-side custom losses are off (client/config custom_loss_server_side=false): "
              "forward_backward_custom runs the loss in the client",
}  # fmt: skip


def _ratio(lp: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - x["logprobs"])


def _clip(config: dict, low: float, high: float) -> tuple[float, float]:
    return float(config.get("clip_low_threshold", low)), float(
        config.get("clip_high_threshold", high)
    )


def cross_entropy(lp: torch.Tensor, x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    weights = x.get("weights")
    return -lp * (weights if weights is not None else 1.0)


def importance_sampling(lp: torch.Tensor, x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    return -(_ratio(lp, x) * x["advantages"])


def ppo(lp: torch.Tensor, x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    low, high = _clip(config, 0.8, 1.2)
    ratio, adv = _ratio(lp, x), x["advantages"]
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


def cispo(lp: torch.Tensor, x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    low, high = _clip(config, 0.0, 4.0)
    coef = torch.clamp(_ratio(lp, x), low, high).detach()
    return -(coef * lp * x["advantages"])


def gspo(lp: torch.Tensor, x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    low, high = float(config["clip_low_threshold"]), float(config["clip_high_threshold"])
    seq_log_ratio = (lp.detach() - x["logprobs"])[x["sequence_ratio_mask"] != 0].mean()
    ratio, adv = torch.exp(seq_log_ratio + lp - lp.detach()), x["advantages"]
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


def dro(lp: torch.Tensor, x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    beta = float(config["beta"])
    return -(lp * x["advantages"] - 0.5 * beta * (lp - x["logprobs"]) ** 2)


LOSSES: dict[str, tuple[LossFn, tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("target_tokens",)),
    "importance_sampling": (importance_sampling, ("target_tokens", "logprobs", "advantages")),
    "ppo": (ppo, ("target_tokens", "logprobs", "advantages")),
    "cispo": (cispo, ("target_tokens", "logprobs", "advantages")),
    "gspo": (gspo, ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")),
    "dro": (dro, ("target_tokens", "logprobs", "advantages")),
}
OPTIONAL = {"cross_entropy": ("weights",)}
CONFIG_NEEDED = {"gspo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",)}


def check_config(loss_fn: str, config: dict) -> None:
    """Refuse a loss setting without a default (Tinker documents none) that is absent or not
    a number."""
    for key in CONFIG_NEEDED.get(loss_fn, ()):
        value = config.get(key)
        if not isinstance(value, int | float):
            raise TinkerRequestError(
                f"loss_fn {loss_fn!r} needs loss_fn_config[{key!r}] as a number (got {value!r}): "
                f"Tinker documents no default for it; pass e.g. "
                f"loss_fn_config={{{', '.join(repr(k) + ': ...' for k in CONFIG_NEEDED[loss_fn])}}}"
            )


def check_request(loss_fn: str, data: list[Datum], *, vocab_size: int, max_length: int,
                  config: dict | None = None) -> None:  # fmt: skip
    """Refuse (TinkerRequestError, naming datum and field) what the loss cannot run on: an
    unknown loss, a missing input or setting, a length that differs from the datum's tokens,
    a token outside the vocabulary, a datum longer than the model's context, a gspo datum
    whose `sequence_ratio_mask` marks no token."""
    if loss_fn not in LOSSES:
        why = REFUSED.get(loss_fn, "unknown loss")
        raise TinkerRequestError(
            f"loss_fn {loss_fn!r}: {why}. This server computes {', '.join(LOSSES)}."
        )
    if not data:
        raise TinkerRequestError("forward_backward got no data (an empty list of Datum)")
    check_config(loss_fn, config or {})
    _, required = LOSSES[loss_fn]
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        if n == 0:
            raise TinkerRequestError(f"data[{i}].model_input is empty")
        if n > max_length:
            raise TinkerRequestError(
                f"data[{i}] has {n} tokens, more than the model's context of {max_length}: "
                "truncate it"
            )
        for key in (*required, *OPTIONAL.get(loss_fn, ())):
            value = datum.inputs.get(key)
            if value is None:
                if key in required:
                    raise TinkerRequestError(
                        f"data[{i}].loss_fn_inputs lacks {key!r}, which {loss_fn} needs "
                        f"(it has {sorted(datum.inputs)})"
                    )
                continue
            if value.ndim != 1 or value.shape[0] != n:
                raise TinkerRequestError(
                    f"data[{i}].loss_fn_inputs[{key!r}] has shape {list(value.shape)} but "
                    f"model_input has {n} tokens: give one value per input token, shape [{n}]"
                )
        mask = datum.inputs.get("sequence_ratio_mask")
        if loss_fn == "gspo" and not np.any(mask != 0):
            raise TinkerRequestError(
                f"data[{i}].loss_fn_inputs['sequence_ratio_mask'] marks no token: mark the "
                "sampled tokens (1.0) the sequence ratio is taken over"
            )
        ids = np.concatenate([np.asarray(datum.tokens, dtype=np.int64),
                              datum.inputs["target_tokens"].astype(np.int64).reshape(-1)])  # fmt: skip
        bad = ids[(ids < 0) | (ids >= vocab_size)].tolist()
        if bad:
            raise TinkerRequestError(
                f"data[{i}] has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )


def loss_inputs(datum: Datum, device: torch.device) -> dict[str, torch.Tensor]:
    """A datum's float inputs as tensors (target_tokens stays out: the logprobs read it)."""
    return {k: torch.tensor(np.asarray(v, dtype=np.float32), device=device)
            for k, v in datum.inputs.items() if k != "target_tokens"}  # fmt: skip
