"""The local engine over real loopback HTTP: generation, logprobs, request shapes, errors.

Every test talks to a real server (tests/conftest.py::local_engine) through `SGLangEngine` or
raw httpx; the reference for numbers is the same HF model run in this process.
"""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
import torch
import trio

from engines import EngineError, SGLangEngine

PROMPTS = [
    [5, 6, 7],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    list(range(60, 85)),
    list(range(100, 140)),
]


@contextlib.contextmanager
def one_torch_thread():
    """Reference computations on one thread: on a shared 2-core machine, 2 OpenMP threads
    competing with other processes made a 60-token forward pass take ~1 s instead of ~5 ms."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def teacher_forced(
    model, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    """log p(output[i] | prompt + output[:i]) from one forward pass over the whole sequence."""
    with torch.no_grad(), one_torch_thread():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


async def wait_for(predicate, timeout: float = 30.0) -> None:
    """Poll a condition on the server's public state (there is no event to wait on over HTTP)."""
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.01)


async def internal_state(engine: SGLangEngine) -> dict:
    return (await engine.server_info())["internal_states"][0]


async def test_output_logprobs_equal_teacher_forced_forward_under_batching(
    local_engine, tiny_hf_model
):
    _, engine = local_engine
    cases = [(p, t) for p in PROMPTS for t in (0.0, 0.7, 1.3)]
    results: dict[int, object] = {}

    async def run(i: int, prompt: list[int], temperature: float) -> None:
        params = {"max_new_tokens": 12 + 3 * i, "temperature": temperature, "ignore_eos": True}
        results[i] = await engine.generate(prompt, params)

    async with (
        trio.open_nursery() as nursery
    ):  # concurrent: rows of different lengths join and leave
        for i, (prompt, temperature) in enumerate(cases):
            nursery.start_soon(run, i, prompt, temperature)

    for i, (prompt, temperature) in enumerate(cases):
        result = results[i]
        assert len(result.output_ids) == len(result.output_logprobs) == 12 + 3 * i
        # greedy reports the raw distribution (SGLang: temperature 0 -> top_k 1 at temperature 1)
        reference = teacher_forced(
            tiny_hf_model, prompt, list(result.output_ids), temperature or 1.0
        )
        assert (
            max(abs(a - b) for a, b in zip(result.output_logprobs, reference, strict=True)) <= 1e-4
        )


async def test_greedy_output_equals_hf_generate(local_engine, tiny_hf_model):
    _, engine = local_engine
    for prompt in PROMPTS:
        result = await engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})
        with torch.no_grad(), one_torch_thread():
            hf = tiny_hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
            )
        assert list(result.output_ids) == hf[0, len(prompt) :].tolist()


async def test_score_equals_teacher_forced_and_input_logprobs_follow_sglang_alignment(
    local_engine, tiny_hf_model
):
    server, engine = local_engine
    ids = list(range(10, 40))
    scored = await engine.score(ids, 10)
    reference = teacher_forced(tiny_hf_model, ids[:10], ids[10:])
    assert len(scored.logprobs) == 20
    assert max(abs(a - b) for a, b in zip(scored.logprobs, reference, strict=True)) <= 1e-4

    async with httpx.AsyncClient(base_url=server.url) as http:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        default = (await http.post("/generate", json=body)).json()
        assert default["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]
        assert default["meta_info"]["output_token_logprobs"] == []
        assert default["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert default["output_ids"] == []

        body.update(logprob_start_len=0, return_text_in_logprobs=True, top_logprobs_num=3)
        full = (await http.post("/generate", json=body)).json()["meta_info"]
        entries = full["input_token_logprobs"]
        assert len(entries) == len(ids) and entries[0][0] is None
        assert [e[1] for e in entries] == ids and all(isinstance(e[2], str) for e in entries)
        assert full["input_top_logprobs"][0] is None
        for top in full["input_top_logprobs"][1:]:
            assert len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0]

        body["logprob_start_len"] = len(ids)
        too_far = await http.post("/generate", json=body)
        assert too_far.status_code == 400
        assert (
            "logprob_start_len (30) is higher than the number of input tokens (30)"
            in (too_far.json()["error"]["message"])
        )


async def test_greedy_top_logprobs_start_with_the_sampled_token(local_engine):
    _, engine = local_engine
    result = await engine.generate(
        PROMPTS[1], {"max_new_tokens": 8, "temperature": 0}, top_logprobs_num=4
    )
    assert result.output_top_logprobs is not None
    for (lp, token), top in zip(
        zip(result.output_logprobs, result.output_ids, strict=True),
        result.output_top_logprobs,
        strict=True,
    ):
        assert top[0] == (lp, token) and len(top) == 4


async def test_single_batch_and_n_response_shapes(local_engine):
    server, engine = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:
        single = (
            await http.post(
                "/generate", json={"text": "12+34=", "sampling_params": {"max_new_tokens": 3}}
            )
        ).json()
        assert isinstance(single, dict) and set(single) >= {"text", "output_ids", "meta_info"}
        meta = single["meta_info"]
        for key in (
            "id",
            "finish_reason",
            "prompt_tokens",
            "weight_version",
            "completion_tokens",
            "cached_tokens",
            "e2e_latency",
        ):
            assert key in meta
        assert meta["weight_version"] == "default"

        batch = (
            await http.post(
                "/generate",
                json={"text": ["a", "bb"], "rid": "r", "sampling_params": {"max_new_tokens": 2}},
            )
        ).json()
        assert [o["meta_info"]["id"] for o in batch] == ["r_0", "r_1"]

        nested = (
            await http.post(
                "/generate",
                json={"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 2}},
            )
        ).json()
        assert isinstance(nested, list) and len(nested) == 1

        body = {
            "input_ids": [[7, 8, 9, 10], [11, 12]],
            "sampling_params": {"max_new_tokens": 2, "n": 3},
        }
        n_out = (await http.post("/generate", json=body)).json()
        assert [o["meta_info"]["prompt_tokens"] for o in n_out] == [
            4,
            4,
            4,
            2,
            2,
            2,
        ]  # prompt-major
        assert len({o["meta_info"]["id"] for o in n_out}) == 6
        # samples of one prompt share its prefill: all but the first report what SGLang's radix
        # tree gives them once the first is in it (max_prefix_len: the prompt minus one token)
        assert [o["meta_info"]["cached_tokens"] for o in n_out] == [0, 3, 3, 0, 1, 1]

        dup = await http.post("/generate", json={"input_ids": [[1], [2]], "rid": ["x", "x"]})
        assert dup.status_code == 400
        assert "Duplicate request IDs detected within the request" in dup.json()["error"]["message"]

    results = await engine.generate_batch([[1, 2], [3, 4]], {"max_new_tokens": 2, "n": 2})
    assert [r.prompt_tokens for r in results] == [2, 2, 2, 2]


def _ascii_token(tokenizer, token_id: int) -> str | None:
    text = tokenizer.decode([token_id])
    return text if text.strip() and text.isascii() and text.isprintable() else None


async def test_stop_strings_stop_tokens_and_length_finish_as_sglang(local_engine, tiny_tokenizer):
    _, engine = local_engine
    prompt = PROMPTS[2]
    # Sampling with a per-request seed is reproducible, and varied enough to find stop targets.
    # The client sends no_stop_trim: true unless told otherwise; the trimming tested here is
    # the engine's (SGLang's default).
    seeded = {"temperature": 1.0, "sampling_seed": 1234, "no_stop_trim": False}
    base = await engine.generate(prompt, {"max_new_tokens": 40, **seeded, "ignore_eos": True})
    ids = list(base.output_ids)
    assert base.finish_reason.type == "length" and base.finish_reason.length == 40

    # a stop token: the output ends with it, the text does not contain it
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    by_token = await engine.generate(
        prompt, {"max_new_tokens": 40, **seeded, "stop_token_ids": [ids[k]]}
    )
    assert list(by_token.output_ids) == ids[: k + 1]
    assert (by_token.finish_reason.type, by_token.finish_reason.matched) == ("stop", ids[k])
    assert by_token.text == tiny_tokenizer.decode(ids[:k], skip_special_tokens=True)

    # a stop string: generation stops at the first token whose text completes it; trimmed
    stop = next(s for s in (_ascii_token(tiny_tokenizer, t) for t in ids[2:]) if s)
    m = next(
        i
        for i in range(1, len(ids) + 1)
        if stop in tiny_tokenizer.decode(ids[:i], skip_special_tokens=True)
    )
    by_string = await engine.generate(prompt, {"max_new_tokens": 40, **seeded, "stop": [stop]})
    full_text = tiny_tokenizer.decode(ids[:m], skip_special_tokens=True)
    assert list(by_string.output_ids) == ids[:m]
    assert (by_string.finish_reason.type, by_string.finish_reason.matched) == ("stop", stop)
    assert by_string.text == full_text[: full_text.find(stop)]
    untrimmed = await engine.generate(
        prompt,
        {"max_new_tokens": 40, **seeded, "stop": stop, "no_stop_trim": True},  # last wins
    )
    assert untrimmed.text == full_text

    # EOS (forced with a logit bias) stops unless ignore_eos
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    forced = {"max_new_tokens": 5, "logit_bias": {str(eos): 100.0}}
    stopped = await engine.generate(prompt, forced)
    assert (
        list(stopped.output_ids) == [eos]
        and stopped.finish_reason.matched == eos
        and stopped.text == ""
    )
    ignored = await engine.generate(prompt, {**forced, "ignore_eos": True})
    assert list(ignored.output_ids) == [eos] * 5 and ignored.finish_reason.type == "length"
    delayed = await engine.generate(prompt, {**forced, "min_new_tokens": 3})
    assert len(delayed.output_ids) == 4 and eos not in delayed.output_ids[:3]


BAD_REQUESTS = [
    # (raw body, expected error shape, message fragment)
    (b"{bad json", "object", "JSON decode error"),
    (b"[1, 2]", "object", "valid dictionary"),
    (b'{"input_ids": [1, 2], "return_logprob": "yes"}', "object", "valid boolean"),
    (b'{"input_ids": "abc"}', "object", "valid list"),
    (b'{"input_ids": [1, "x"]}', "object", "list of integers"),
    (b'{"input_ids": []}', "native", "input_ids cannot be empty."),
    (
        b'{"sampling_params": {}}',
        "native",
        "Either text, input_ids or input_embeds should be provided.",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"top_p": 0}}',
        "native",
        "top_p must be in (0, 1], got 0.0.",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"temperature": -1}}',
        "native",
        "temperature must be a non-negative finite number, got -1.0.",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"top_k": 0}}',
        "native",
        "top_k must be -1 (disable) or at least 1, got 0.",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}',
        "native",
        "max_new_tokens must be at least 0, got -1.",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}}',
        "native",
        "min_new_tokens must be in [0, max_new_tokens(2)], got 5.",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}',
        "native",
        "repetition_penalty must be in (0, 2]",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}',
        "native",
        "temperature must be a number",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"regex": "a+"}}',
        "native",
        "not supported by the local engine",
    ),
    (
        b'{"input_ids": [1], "sampling_params": {"max_tokens": 5}}',
        "native",
        "Unknown sampling parameter(s): max_tokens.",
    ),
    (b'{"input_ids": [1, 2, 99999]}', "native", "outside the vocabulary"),
    (
        json.dumps({"input_ids": [1] * 1100}).encode(),
        "native",
        "The input (1100 tokens) is longer than the model's context length (1024 tokens).",
    ),
    (
        json.dumps({"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}}).encode(),
        "native",
        "Requested token count exceeds the model's maximum context length of 1024 tokens.",
    ),
]


async def test_bad_requests_answer_sglang_400_shapes_and_the_server_keeps_serving(local_engine):
    server, engine = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:
        for raw, shape, fragment in BAD_REQUESTS:
            response = await http.post("/generate", content=raw)
            assert response.status_code == 400, raw
            body = response.json()
            if shape == "object":
                assert (
                    body["object"] == "error"
                    and body["code"] == 400
                    and body["type"] == "Bad Request"
                )
                assert fragment in body["message"], (raw, body)
            else:
                assert fragment in body["error"]["message"], (raw, body)
        missing = await http.get("/no_such_route")
        assert missing.status_code == 404 and missing.json()["object"] == "error"
        wrong_method = await http.get("/generate")
        assert wrong_method.status_code == 405
    with pytest.raises(EngineError) as info:
        await engine.generate([1], {"top_p": 0})
    assert info.value.status == 400 and "top_p must be in (0, 1]" in str(info.value)
    result = await engine.generate([1, 2, 3], {"max_new_tokens": 4})
    assert len(result.output_ids) == 4


async def test_a_request_failing_inside_generation_answers_500_and_others_finish(
    local_engine, tiny_tokenizer
):
    server, engine = local_engine
    # Banning every token leaves no distribution to sample from: a failure inside the step.
    ban_all = ", ".join(f'"{t}": -Infinity' for t in range(len(tiny_tokenizer)))
    raw = f'{{"input_ids": [1, 2, 3], "sampling_params": {{"logit_bias": {{{ban_all}}}}}}}'.encode()
    outcome: dict[str, object] = {}

    async def good() -> None:
        outcome["good"] = await engine.generate(
            [4, 5, 6], {"max_new_tokens": 30, "ignore_eos": True}
        )

    async with trio.open_nursery() as nursery, httpx.AsyncClient(base_url=server.url) as http:
        nursery.start_soon(good)
        outcome["bad"] = await http.post("/generate", content=raw)
    bad = outcome["bad"]
    assert bad.status_code == 500 and "Sampling failed" in bad.json()["message"]
    assert len(outcome["good"].output_ids) == 30
    assert (await engine.generate([7, 8], {"max_new_tokens": 2})).completion_tokens == 2


async def test_a_new_request_joins_the_running_batch_instead_of_waiting(local_engine):
    _, engine = local_engine
    finished: list[str] = []

    async def long_request() -> None:
        result = await engine.generate(
            [9, 9, 9], {"max_new_tokens": 1000, "ignore_eos": True}, rid="long"
        )
        finished.append(f"long:{result.finish_reason.type}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_request)
        await wait_for(lambda: _running(engine, 1))
        short = await engine.generate([1, 2, 3], {"max_new_tokens": 4})
        finished.append("short")
        assert finished == ["short"]  # done while the long one is still generating
        await engine.abort("long")
    assert finished == ["short", "long:abort"]
    assert short.completion_tokens == 4


async def _running(engine: SGLangEngine, count: int) -> bool:
    return (await internal_state(engine))["num_running_reqs"] == count


async def test_health_and_info_endpoints(local_engine):
    server, engine = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:
        for path in ("/health", "/health_generate"):
            response = await http.get(path)
            assert response.status_code == 200 and response.content == b""
        for path in ("/get_model_info", "/model_info"):
            info = (await http.get(path)).json()
            assert info["model_path"] == str(server.config.model_path)
            assert info["is_generation"] is True and info["weight_version"] == "default"
            assert {"tokenizer_path", "preferred_sampling_params"} <= set(info)
        for path in ("/get_server_info", "/server_info"):
            info = (await http.get(path)).json()
            assert info["tp_size"] == 1 and info["dp_size"] == 1
            assert isinstance(info["max_total_num_tokens"], int) and isinstance(
                info["version"], str
            )
            assert isinstance(info["internal_states"], list) and "api_key" not in info
        models = (await http.get("/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["id"] == str(
            server.config.model_path
        )
        unknown = await http.get("/v1/models/nope")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert (await http.get("/get_weight_version")).status_code == 404
    assert (await engine.model_info()).weight_version == "default"


async def test_top_k_top_p_and_min_p_restrict_what_is_sampled(local_engine):
    _, engine = local_engine
    prompt = PROMPTS[1]
    for params, allowed in (({"top_k": 2}, 2), ({"top_p": 1e-6}, 1), ({"min_p": 1.0}, 1)):
        result = await engine.generate(
            prompt, {"max_new_tokens": 30, "ignore_eos": True, **params}, top_logprobs_num=2
        )
        for token, top in zip(result.output_ids, result.output_top_logprobs, strict=True):
            assert token in [t for _, t in top[:allowed]], params
