"""`rollouts tinker-serve` driven by the real `tinker` SDK (a client nobody here wrote).

One server (and its LoRA-enabled local engine) on 127.0.0.1 for the module, on the tiny model.
Properties: the numbers the SDK gets are the ones computed independently here with the HF
model (per-token logprobs and the summed loss); the SL loss falls; an RL round trip samples
with the weights just saved (the version moves, and the engine's logprobs of a sampled
sequence equal the trainer's); requests sent without waiting run in seq_id order; bad input
is an error the SDK raises, naming the cause, and the server goes on serving.
"""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
import torch
import trio

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rollouts.tinker_server.futures import FutureTable, ModelQueue  # noqa: E402
from rollouts.tinker_server.serve import open_tinker_server  # noqa: E402

DATA = [list(range(5, 25)), [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token datum: input tokens[:-1], targets tokens[1:], the first 3 targets unweighted."""
    n = len(tokens) - 1
    w = weights if weights is not None else [0.0] * 3 + [1.0] * (n - 3)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": w})  # fmt: skip


def hf_target_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i + 1] | tokens[: i + 1]) under `model`, computed here (one forward)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


@contextlib.contextmanager
def tinker_server_thread(model_dir, run_dir, **options):
    """A tinker server running in a thread of its own (the SDK is sync); yields it."""
    box: dict = {}
    stop = threading.Event()

    async def run() -> None:
        async with open_tinker_server(model_dir, run_dir, model_names=("tiny",),
                                      max_lora_rank=8, num_threads=1, **options) as srv:  # fmt: skip
            box["server"] = srv
            while not stop.is_set():
                await trio.sleep(0.05)

    thread = threading.Thread(target=lambda: trio.run(run), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while "server" not in box:
        assert thread.is_alive() and time.monotonic() < deadline, "the tinker server did not start"
        time.sleep(0.05)
    try:
        yield box["server"]
    finally:
        stop.set()
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One datum per forward_backward request: the SDK sends a batch's chunks at once, the
    first one last, so every multi-datum call here arrives out of seq_id order."""
    with tinker_server_thread(tiny_model_dir, tmp_path_factory.mktemp("tinker_runs"),
                              client_config={"fwdbwd_max_chunk_len": 1}) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def service_client(server):
    # closed (POST /sessions/{id}/finish) while the server is up: its heartbeat thread would
    # outlive the module's server and log connection failures into the rest of the suite
    with tinker.ServiceClient(base_url=server.url, api_key="tml-local") as client:
        yield client


def lora_client(service_client, seed: int = 0):
    return service_client.create_lora_training_client(base_model="tiny", rank=4,
                                                      seed=seed).result()  # fmt: skip


def test_sl_loop_loss_falls_and_the_sdk_numbers_are_the_hf_models(service_client, server,
                                                                  tiny_hf_model):  # fmt: skip
    tc = lora_client(service_client)
    batch = [datum(t) for t in DATA]
    first = tc.forward_backward(batch, "cross_entropy").result()
    # LoRA's B starts at 0: at step 0 the policy is the base model, computed here independently
    for out, tokens, d in zip(first.loss_fn_outputs, DATA, batch, strict=True):
        want = hf_target_logprobs(tiny_hf_model, tokens)
        assert torch.allclose(out["logprobs"].to_torch(), want, atol=1e-5)
        w = d.loss_fn_inputs["weights"].to_torch()
        assert torch.allclose(out["elementwise_loss"].to_torch(), -want * w, atol=1e-5)
    want_sum = sum(float(o["elementwise_loss"].to_torch().sum()) for o in first.loss_fn_outputs)
    assert first.metrics["loss:sum"] == pytest.approx(want_sum, rel=1e-5)
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-8, grad_clip_norm=100.0)
    tc.optim_step(adam).result()
    losses = [first.metrics["loss:sum"]]
    for _ in range(19):  # 20 forward_backward + optim_step calls in all (issue 44)
        fb = tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(adam)
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.85 * losses[0], losses
    # after training, the SDK's logprobs are still the model's: the trained adapter computed here
    model = server.service.models[tc.model_id].backend.model
    out = tc.forward(batch, "cross_entropy").result()
    for o, tokens in zip(out.loss_fn_outputs, DATA, strict=True):
        assert torch.allclose(o["logprobs"].to_torch(), hf_target_logprobs(model, tokens),
                              atol=1e-5)  # fmt: skip


def rl_datum(prompt: list[int], seq, advantage: float) -> types.Datum:
    ob = len(prompt) - 1
    tokens = list(seq.tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={"target_tokens": [0] * ob + tokens,
                        "logprobs": [0.0] * ob + list(seq.logprobs),
                        "advantages": [0.0] * ob + [advantage] * len(tokens)},
    )  # fmt: skip


def test_rl_loop_samples_the_weights_just_saved(service_client, server):
    tc = lora_client(service_client, seed=1)
    prompt = [5, 6, 7, 8, 9]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])
    sampler = tc.save_weights_and_get_sampling_client().result()
    v0 = server.service.samplers[sampler._sampling_session_id].version
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    assert [len(s.tokens) for s in res.sequences] == [6, 6]
    data = [rl_datum(prompt, s, a) for s, a in zip(res.sequences, (1.0, -1.0), strict=True)]
    fb = tc.forward_backward(data, "importance_sampling")
    ppo = tc.forward(data, "ppo")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    ob = len(prompt) - 1
    for out, seq, p in zip(fb.result().loss_fn_outputs, res.sequences,
                           ppo.result().loss_fn_outputs, strict=True):  # fmt: skip
        # same weights as the sampler's: the trainer's logprobs of the sample are the engine's
        trained = out["logprobs"].to_torch()[ob:]
        assert torch.allclose(trained, torch.tensor(seq.logprobs), atol=1e-4)
        assert torch.equal(p["logprobs"].to_torch(), out["logprobs"].to_torch())
    sampler2 = tc.save_weights_and_get_sampling_client().result()
    v1 = server.service.samplers[sampler2._sampling_session_id].version
    assert (v0, v1) == (0, 1)
    res2 = sampler2.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    seq = res2.sequences[0]
    check = types.Datum(model_input=types.ModelInput.from_ints(prompt + list(seq.tokens[:-1])),
                        loss_fn_inputs={"target_tokens": [0] * ob + list(seq.tokens)})  # fmt: skip
    trainer = tc.forward([check], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    assert torch.allclose(trainer.to_torch()[ob:], torch.tensor(seq.logprobs), atol=1e-4)
    # the old sampler still samples version 0 (its own adapter): its logprobs differ
    again = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    assert server.service.samplers[sampler._sampling_session_id].adapter.endswith("-v0")
    assert again.logprobs != seq.logprobs
    # named sampler weights, sampled through a client made from their path
    path = tc.save_weights_for_sampler("named").result().path
    assert path.endswith("/sampler_weights/named")
    by_path = service_client.create_sampling_client(model_path=path).result()
    named = by_path.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    assert len(named.tokens) == 6


def test_requests_sent_without_waiting_run_in_order(service_client, server):
    batch = [datum(t) for t in DATA]
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-8)
    waited = lora_client(service_client, seed=3)
    one_by_one = []
    for _ in range(3):
        one_by_one.append(waited.forward_backward(batch, "cross_entropy").result())
        waited.optim_step(adam).result()
    queued = lora_client(service_client, seed=3)
    futures = [(queued.forward_backward(batch, "cross_entropy"), queued.optim_step(adam))
               for _ in range(3)]  # fmt: skip
    steps = [o.result().metrics["step"] for _, o in futures]
    losses = [f.result().metrics["loss:sum"] for f, _ in futures]
    assert steps == [1.0, 2.0, 3.0]
    assert losses == pytest.approx([r.metrics["loss:sum"] for r in one_by_one], rel=1e-6)
    assert len(set(losses)) == 3  # each forward_backward saw the step before it
    assert server.service.queues[queued.model_id].early > 0  # chunks did arrive out of order


async def test_a_model_queue_runs_requests_by_seq_id_whatever_their_arrival():
    ran: list[int] = []

    def job(k: int):
        async def run() -> int:
            await trio.sleep(0)
            ran.append(k)
            return k

        return run

    async with trio.open_nursery() as nursery:
        table = FutureTable(poll_wait_s=5)
        queue = ModelQueue(nursery, table, "m")
        ids = [queue.submit(seq, job(seq)) for seq in (3, 2, 4, 1)]
        for rid in ids:
            entry = await table.wait(rid)
            assert entry is not None and entry.error is None
        again = await table.wait(queue.submit(2, job(99)))
        # a seq_id that never arrives fails the requests behind it, naming it
        gappy = ModelQueue(nursery, table, "g", gap_timeout_s=0.2)
        stuck = await table.wait(gappy.submit(2, job(22)))
        nursery.cancel_scope.cancel()
    assert ran == [1, 2, 3, 4]
    assert again is not None and "seq_id 2 was already used" in again.error.message
    assert stuck is not None and "for seq_id 1, which never arrived" in stuck.error.message


def test_bad_input_is_an_sdk_error_naming_the_cause(service_client, server):
    good = lora_client(service_client, seed=5)
    d = datum(DATA[0])
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce.*importance_sampling"):
        lora_client(service_client).forward_backward([d], "stable_reinforce").result()
    short = datum(DATA[0], weights=[1.0] * 5)
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].*'weights'.*shape \[5\]"):
        lora_client(service_client).forward_backward([short], "cross_entropy").result()
    long = datum(list(range(3, 100)) * 11)  # 1,066 tokens > the tiny model's 1,024
    with pytest.raises(tinker.RequestFailedError, match="more than the model's context"):
        lora_client(service_client).forward_backward([long], "cross_entropy").result()
    outside = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                          loss_fn_inputs={"target_tokens": [6, 7, 999]})  # fmt: skip
    with pytest.raises(
        tinker.RequestFailedError, match=r"outside the vocabulary \[0, 371\): \[999\]"
    ):
        lora_client(service_client).forward_backward([outside], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="not served here.*tiny"):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.public_interfaces.training_client import TrainingClient

    ghost = TrainingClient(good.holder, model_seq_id=99, model_id="no-such-model", info=good._info)
    with pytest.raises(tinker.NotFoundError, match="unknown model_id 'no-such-model'"):
        ghost.optim_step(types.AdamParams()).result()
    missing = _APIFuture(types.OptimStepResponse, good.holder,
                         types.UntypedAPIFuture(request_id="no-such-future"),
                         request_start_time=time.time(), request_type="OptimStep")  # fmt: skip
    with pytest.raises(ValueError, match="no request 'no-such-future'"):
        missing.result()
    base = service_client.create_sampling_client(base_model="tiny").result()
    with pytest.raises(tinker.RequestFailedError, match="engine refused the sample.*temperature"):
        base.sample(types.ModelInput.from_ints([5, 6]), 1,
                    types.SamplingParams(max_tokens=2, temperature=-1.0)).result()  # fmt: skip
    garbage = httpx.post(f"{server.url}/api/v1/forward_backward", content=b"\xff" * 40,
                         headers={"Content-Type": "application/x-protobuf"})  # fmt: skip
    assert garbage.status_code == 400 and "not a ForwardBackwardRequest" in garbage.text
    # and the server goes on serving its other clients
    assert good.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_restarted_server_resumes_a_saved_state_on_the_same_loss_curve(service_client, server,
                                                                         tiny_model_dir):  # fmt: skip
    batch = [datum(t) for t in DATA]
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-8)
    tc = lora_client(service_client, seed=7)
    for _ in range(2):
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(adam)
    path = tc.save_state("mid").result().path
    after = []
    for _ in range(2):
        after.append(tc.forward_backward(batch, "cross_entropy"))
        tc.optim_step(adam)
    after = [f.result().metrics["loss:sum"] for f in after]
    # load_state_with_optimizer onto the same client rewinds it: the same two steps again
    tc.load_state_with_optimizer(path).result()
    rewound = []
    for _ in range(2):
        rewound.append(tc.forward_backward(batch, "cross_entropy"))
        tc.optim_step(adam)
    assert [f.result().metrics["loss:sum"] for f in rewound] == pytest.approx(after, rel=1e-6)
    assert path in [c.tinker_path for c in tinker.RestClient(base_url=server.url, api_key="tml-local")
                    .list_checkpoints(tc.model_id).result().checkpoints]  # fmt: skip
    # a new server process state on the same run directory (the engine is reused: cheaper); the
    # client is closed before the server stops: an open client's session heartbeat thread would
    # go on failing against the stopped server for the rest of the test process
    with (
        tinker_server_thread(tiny_model_dir, server.service.run_root,
                             engine_url=server.service.engine.url) as restarted,
        tinker.ServiceClient(base_url=restarted.url, api_key="tml-local") as client,
    ):  # fmt: skip
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        again = []
        for _ in range(2):
            again.append(resumed.forward_backward(batch, "cross_entropy"))
            resumed.optim_step(adam)
        again = [f.result().metrics["loss:sum"] for f in again]
    assert again == pytest.approx(after, rel=1e-6)


def test_forward_backward_custom_trains_as_the_same_builtin_loss(service_client):
    """The SDK runs a custom loss client-side: forward, its autograd, then cross_entropy with
    the gradient as weights; a custom loss equal to cross_entropy must step the same way."""
    batch = [datum(t) for t in DATA]
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-8)

    def custom(data, logprobs_list):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum()
                   for d, lp in zip(data, logprobs_list, strict=True))  # fmt: skip
        return loss, {}

    losses = []
    for use_custom in (True, False):
        tc = lora_client(service_client, seed=9)
        if use_custom:
            tc.forward_backward_custom(batch, custom).result()
        else:
            tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(adam).result()
        losses.append(tc.forward(batch, "cross_entropy").result().metrics["loss:sum"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_seeded_samples_repeat_and_differ_and_prompt_logprobs_are_the_models(
    service_client, server, tiny_hf_model
):
    rest = tinker.RestClient(base_url=server.url, api_key="tml-local")
    served = rest.get_server_capabilities().result().supported_models
    assert served[0].model_name == "tiny" and served[0].trainable
    sampler = service_client.create_sampling_client(base_model="tiny").result()
    prompt = [5, 6, 7, 8, 9, 10]
    params = types.SamplingParams(max_tokens=5, seed=3, stop=[])

    def draw():
        out = sampler.sample(types.ModelInput.from_ints(prompt), 2, params,
                             include_prompt_logprobs=True).result()  # fmt: skip
        return out, [list(s.tokens) for s in out.sequences]

    first, tokens = draw()
    _, again = draw()
    assert again == tokens and tokens[0] != tokens[1]  # reproducible, yet a group of 2 samples
    assert first.prompt_logprobs[0] is None
    want = hf_target_logprobs(tiny_hf_model, prompt)
    assert torch.allclose(torch.tensor(first.prompt_logprobs[1:]), want, atol=1e-4)
    # SamplingClient.compute_logprobs (the cookbook's scorer), whole and the last 3 only
    whole = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert torch.allclose(torch.tensor(whole[1:]), want, atol=1e-4)
    tail = sampler.compute_logprobs(types.ModelInput.from_ints(prompt), 3).result()
    assert tail[:3] == [None] * 3
    assert torch.allclose(torch.tensor(tail[3:]), want[-3:], atol=1e-4)


def test_saving_weights_does_not_abort_samples_in_flight(service_client):
    """An async loop samples with an older sampling client while the trainer saves new
    weights: the engine's pause for the push must keep those samples, not abort them."""
    tc = lora_client(service_client, seed=11)
    old = tc.save_weights_and_get_sampling_client().result()
    long = types.SamplingParams(max_tokens=400, temperature=1.0, stop=[])
    running = old.sample(types.ModelInput.from_ints([5, 6, 7]), 1, long)
    time.sleep(0.2)  # let it start decoding
    tc.forward_backward([datum(DATA[0])], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2))
    tc.save_weights_and_get_sampling_client().result()
    assert len(running.result().sequences[0].tokens) == 400


def test_a_zstd_body_that_inflates_past_the_bound_is_refused_not_decompressed():
    import zstandard

    from rollouts.tinker_server.wire import TinkerRequestError, decode_body

    body = zstandard.ZstdCompressor().compress(b"\0" * 100_000)  # ~20 bytes on the wire
    assert decode_body(body, {"content-encoding": "zstd"}) == b"\0" * 100_000
    with pytest.raises(TinkerRequestError, match="inflates past 1000 bytes") as refused:
        decode_body(body, {"content-encoding": "zstd"}, limit=1000)
    assert refused.value.status == 413


def gspo_token_elementwise(lp, q, adv, mask, low, high):
    """Tinker's GSPO (GSPO-token, tinker-docs losses/gspo), written out here: every token takes
    the sequence ratio exp(mean over the masked tokens of lp - q) as its value, with the
    gradient of its own logprob; loss -min(r * A, clip(r, low, high) * A) per token."""
    seq_log_ratio = (lp.detach() - q)[mask != 0].mean()
    ratio = torch.exp(seq_log_ratio + lp - lp.detach())
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


def dro_elementwise(lp, q, adv, beta):
    """Tinker's DRO (tinker-docs losses): -(lp * A - beta / 2 * (lp - q)^2) per token."""
    return -(lp * adv - 0.5 * beta * (lp - q) ** 2)


def test_gspo_and_dro_are_tinkers_formulas_in_value_and_gradient(service_client, tiny_hf_model):
    gen = torch.Generator().manual_seed(0)
    data, parts = [], []
    # the second datum's sequence ratio is about e^0.2 = 1.22, past the 1.1 threshold: its
    # tokens with A > 0 are clipped (no gradient), those with A < 0 are not
    for tokens, shift in zip(DATA, (0.0, -0.2), strict=True):
        lp = hf_target_logprobs(tiny_hf_model, tokens)  # the policy at step 0 (LoRA B = 0)
        n, ob = len(lp), 3
        q = lp + shift + 0.1 * torch.randn(n, generator=gen)
        adv = torch.cat([torch.zeros(ob), torch.randn(n - ob, generator=gen)])
        mask = torch.cat([torch.zeros(ob), torch.ones(n - ob)])
        parts.append((lp, q, adv, mask))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:],
                                                "logprobs": q.tolist(),
                                                "advantages": adv.tolist(),
                                                "sequence_ratio_mask": mask.tolist()}))  # fmt: skip
    gspo_config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    cases = {
        "gspo": (gspo_config, lambda lp, q, a, m: gspo_token_elementwise(lp, q, a, m, 0.9, 1.1)),
        "dro": ({"beta": 0.5}, lambda lp, q, a, m: dro_elementwise(lp, q, a, 0.5)),
    }
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-8)
    for loss_fn, (config, formula) in cases.items():
        out = lora_client(service_client).forward(data, loss_fn, config).result()
        for o, (lp, q, adv, mask) in zip(out.loss_fn_outputs, parts, strict=True):
            want = formula(lp, q, adv, mask)
            assert torch.allclose(o["elementwise_loss"].to_torch(), want, atol=1e-5), loss_fn
        want_sum = sum(float(formula(*p).sum()) for p in parts)
        assert out.metrics["loss:sum"] == pytest.approx(want_sum, rel=1e-4, abs=1e-5)

        # the gradient: one step of the served loss = one step of the formula run client-side
        def custom(batch, logprobs_list, formula=formula):
            loss = sum(formula(lp, *(d.loss_fn_inputs[k].to_torch() for k in
                                     ("logprobs", "advantages", "sequence_ratio_mask"))).sum()
                       for d, lp in zip(batch, logprobs_list, strict=True))  # fmt: skip
            return loss, {}

        after = []
        for served in (True, False):
            tc = lora_client(service_client, seed=11)
            if served:
                tc.forward_backward(data, loss_fn, config).result()
            else:
                tc.forward_backward_custom(data, custom).result()
            tc.optim_step(adam).result()
            after.append(tc.forward(data, loss_fn, config).result().metrics["loss:sum"])
        assert after[0] == pytest.approx(after[1], rel=1e-4), loss_fn
    # without the settings Tinker's docs give no default for, each is refused, naming them
    tc = lora_client(service_client)
    for loss_fn, key in (("gspo", "clip_low_threshold"), ("dro", "beta")):
        with pytest.raises(tinker.RequestFailedError, match=key):
            tc.forward(data, loss_fn).result()


async def test_a_model_id_asked_for_twice_at_once_is_built_once(tiny_model_dir, tmp_path):
    # an SDK that resends create_model (its answer was lost) asks for the same model_id while
    # the first build runs in its thread: the second must be refused as for a model that
    # exists, not build another and replace the first (its queue, its trained state)
    from rollouts.tinker_server.service import TinkerService
    from rollouts.tinker_server.trainer import TinkerModel
    from rollouts.tinker_server.wire import TinkerRequestError

    outcomes: list[object] = []
    async with trio.open_nursery() as nursery:
        service = TinkerService(str(tiny_model_dir), tmp_path, None, nursery,
                                model_names=("tiny",))  # fmt: skip

        async def create() -> None:
            try:
                outcomes.append(await service.create_model("s:train:0", "tiny", None, 0))
            except TinkerRequestError as exc:
                outcomes.append(exc)

        async with trio.open_nursery() as creating:
            creating.start_soon(create)
            creating.start_soon(create)
        nursery.cancel_scope.cancel()
    built = [o for o in outcomes if isinstance(o, TinkerModel)]
    refused = [o for o in outcomes if isinstance(o, TinkerRequestError)]
    assert len(built) == len(refused) == 1
    assert "exists already" in refused[0].message
    assert service.models["s:train:0"] is built[0]
