"""`rollouts view`: the page of a real tiny RL run, and of a synthetic run with every shape, as a
real headless browser shows it (DOM after the scripts ran; console errors captured)."""

from __future__ import annotations

import html
import json
import math
import re
import statistics
import threading
from pathlib import Path

import pytest
import trio

from tests.viewer_helpers import (
    MISSING_CHROMIUM,
    chromium_dom,
    count,
    have_chromium,
    write_synthetic_run,
)
from training.rl.rollout_dump import read_rollout_dump
from training.viewer.site import build_site

browser = pytest.mark.skipif(not have_chromium(), reason=MISSING_CHROMIUM)


def varied_reward(sample) -> float:
    return (sum(sample.response_ids) % 3) / 2  # 0, 0.5 or 1: groups with a spread


@pytest.fixture(scope="module")
def real_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A 3-step GRPO run of the tiny model against the local engine (in this process), with its
    rollouts dumped and a checkpoint per step; then its site, with the trainer's logprobs."""
    from engines.local import open_local_engine
    from training.recipes.rl import RLExtensions, run_rl_recipe
    from training.rl_config import RLRunConfig

    tmp = tmp_path_factory.mktemp("viewer_run")
    data = tmp / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}", "answer": "{2 * i}"}}\n' for i in range(8)))

    async def main() -> None:
        async with open_local_engine(tiny_model_dir, num_threads=1) as server:
            config = RLRunConfig.model_validate({
                "output_dir": str(tmp / "run"), "sft_config": None,
                "model": {"path": str(tiny_model_dir)},
                "data": {"train_path": str(data), "task": None},
                "engines": {"urls": [server.url]},
                "rollout": {"batch_size": 2, "n_samples_per_prompt": 3, "filter_groups": "none",
                            "sampling": {"max_new_tokens": 6}},
                "train": {"max_steps": 3, "checkpoint_every": 1, "keep_last": 5,
                          "eval_samples": 0, "dump_rollouts": True},
                "backend": {"num_threads": 1},
            })  # fmt: skip
            await run_rl_recipe(config, extensions=RLExtensions(reward_fn=varied_reward))

    trio.run(main)
    build_site(tmp / "run", mismatch=True)
    return tmp / "run"


def page(run: Path, hash_: str = "") -> tuple[str, list[str]]:
    return chromium_dom((run / "viewer" / "index.html").resolve().as_uri() + hash_)


def shown_groups(dom: str) -> int:
    return count(dom, r'<div class="group" ')


def token_spans(dom: str) -> list[tuple[str, str]]:
    """(class, attributes) of each token span of the DOM, in order."""
    return re.findall(r'<span class="(tok(?: env)?)"([^>]*)>', dom)


@browser
def test_real_run_page_shows_every_group_and_token_of_each_step_without_console_errors(real_run):
    batches = read_rollout_dump(real_run / "rollouts.jsonl")
    assert sorted(batches) == [1, 2, 3]
    for step, batch in batches.items():
        dom, console = page(real_run, f"#step={step}")
        assert console == []
        assert f'id="step-now">step {step}<' in dom
        assert shown_groups(dom) == len(batch.groups)
        assert len(token_spans(dom)) == sum(len(s.response_ids) for s in batch.samples)


@browser
def test_logprob_colouring_gives_each_token_its_engine_logprob_and_hue(real_run):
    batch = read_rollout_dump(real_run / "rollouts.jsonl")[2]
    dom, console = page(real_run, "#step=2&color=logprob")
    assert console == []
    spans = token_spans(dom)
    engine = [lp for s in batch.samples for lp in s.rollout_logprobs]
    shown = [float(re.search(r'data-lp="([^"]+)"', attrs).group(1)) for _, attrs in spans]
    assert shown == pytest.approx(engine, abs=1e-12)
    for (_, attrs), lp in zip(spans, engine, strict=True):  # hue 0 (p = 0) … 120 (p = 1)
        assert "background" in attrs
        assert int(re.search(r'data-shade="(\d+)"', attrs).group(1)) == round(120 * math.exp(lp))
    plain, _ = page(real_run, "#step=2&color=none")
    assert len(token_spans(plain)) == len(spans)
    assert not any(
        "background" in attrs or "data-shade" in attrs for _, attrs in token_spans(plain)
    )


@browser
def test_mismatch_colouring_scores_each_token_with_the_weights_that_sampled_it(real_run):
    """Trainer and engine run the same weights in float32: per token they agree to float noise.
    Scoring with the wrong version, or one position off, would differ by whole nats."""
    dom, console = page(real_run, "#step=3&color=mismatch")
    assert console == []
    pairs = [(float(re.search(r'data-lp="([^"]+)"', a).group(1)),
              float(re.search(r'data-tlp="([^"]+)"', a).group(1))) for _, a in token_spans(dom)]  # fmt: skip
    assert pairs and max(abs(e - t) for e, t in pairs) < 1e-4
    shades = [float(re.search(r'data-shade="([^"]+)"', a).group(1)) for _, a in token_spans(dom)]
    expected = [max(0.0, min(1.0, (math.log10(max(abs(e - t), 1e-12)) + 6) / 6)) for e, t in pairs]
    assert shades == pytest.approx(expected, abs=1e-3)


@browser
def test_advantages_shown_are_the_group_normalised_rewards(real_run):
    batch = read_rollout_dump(real_run / "rollouts.jsonl")[1]
    dom, _ = page(real_run, "#step=1")
    shown = [float(x) for x in re.findall(r'data-adv="([^"]+)"', dom)]
    expected = []
    for group in batch.groups:
        rewards = [s.reward for s in group]
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        expected += [0.0 if std < 1e-6 else (r - mean) / (std + 1e-6) for r in rewards]
    assert shown == pytest.approx(expected, abs=1e-5)


@browser
def test_reward_filter_shows_only_groups_with_a_sample_in_range(real_run):
    batches = read_rollout_dump(real_run / "rollouts.jsonl")
    for step, batch in batches.items():
        dom, console = page(real_run, f"#step={step}&rmin=1")
        assert console == []
        assert shown_groups(dom) == sum(any(s.reward >= 1 for s in g) for g in batch.groups)
        dimmed = count(dom, r'<div class="sample dim"')
        shown = [s for g in batch.groups if any(x.reward >= 1 for x in g) for s in g]
        assert dimmed == sum(s.reward < 1 for s in shown)


# ----- a synthetic run: failures, truncation, tools, branches, many steps --------------------


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    run = write_synthetic_run(tmp_path_factory.mktemp("viewer_syn") / "run", steps=20)
    build_site(run)
    return run


def synthetic_batches(run: Path):
    return read_rollout_dump(run / "rollouts.jsonl")


@browser
@pytest.mark.parametrize("name, keep", [
    ("failed", lambda s: s.status == "failed"),
    ("truncated", lambda s: s.status == "truncated"),
    ("tools", lambda s: bool(s.tool_calls)),
])  # fmt: skip
def test_status_and_tool_filters_show_the_groups_holding_such_a_sample(synthetic, name, keep):
    batch = synthetic_batches(synthetic)[7]
    dom, console = page(synthetic, f"#step=7&filter={name}")
    assert console == []
    assert shown_groups(dom) == sum(any(keep(s) for s in g) for g in batch.groups) > 0
    undimmed = count(dom, r'<div class="sample(?: branch)?" ')
    assert undimmed == sum(keep(s) for g in batch.groups if any(keep(x) for x in g) for s in g)


@browser
def test_model_output_is_rendered_as_text_never_as_markup(synthetic):
    dom, console = page(synthetic, "#step=4&filter=failed")
    assert console == []
    error = "reward raised ValueError: could not parse <b>answer</b>"
    assert html.escape(error, quote=False) in dom and "<b>answer</b>" not in dom


@browser
def test_tool_turns_and_branches_are_shown_with_their_calls(synthetic):
    batch = synthetic_batches(synthetic)[5]
    dom, _ = page(synthetic, "#step=5")
    samples = batch.samples
    assert count(dom, r'<div class="sample branch') == sum(s.sub_index > 0 for s in samples)
    assert count(dom, r'<div class="tool(?: bad)?">') == sum(len(s.tool_calls) for s in samples)
    assert count(dom, r'<div class="tool bad">') == sum(
        not c.success for s in samples for c in s.tool_calls
    )
    env_tokens = sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples)
    assert [c for c, _ in token_spans(dom)].count("tok env") == env_tokens
    assert count(dom, r'<span class="turn env">') == sum(0 in s.loss_mask for s in samples)


@browser
def test_step_range_filter_lists_only_those_steps_and_loads_only_the_shown_one(synthetic):
    dom, console = page(synthetic, "#from=5&to=9&step=6")
    assert console == []
    assert re.findall(r'<tr class="[^"]*" data-step="(\d+)"', dom) == ["5", "6", "7", "8", "9"]
    assert 'data-steps-loaded="1"' in dom  # lazy: one step file of twenty


def lcs(a: list, b: list) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) - 1, -1, -1):
        for j in range(len(b) - 1, -1, -1):
            table[i][j] = (table[i + 1][j + 1] + 1 if a[i] == b[j]
                           else max(table[i + 1][j], table[i][j + 1]))  # fmt: skip
    return table[0][0]


@browser
def test_prompt_diff_across_steps_marks_the_tokens_that_changed(synthetic):
    from training.viewer.run_data import prompt_key

    batches = synthetic_batches(synthetic)
    group = batches[1].groups[1]
    key = prompt_key(group[0].prompt_ids)
    dom, console = page(synthetic, f"#diff={key}&from=1&to=3")
    assert console == []
    blocks = re.split(r'<div class="diff-step" data-step="', dom)[1:]
    assert [b.split('"')[0] for b in blocks] == ["1", "2", "3"]
    for step, block in zip((2, 3), blocks[1:], strict=True):
        before = {(s.index_in_group, s.sub_index): s for s in batches[step - 1].groups[1]}
        inserted = deleted = 0
        for s in batches[step].groups[1]:
            a, b = list(before[(s.index_in_group, s.sub_index)].response_ids), list(s.response_ids)
            common = lcs(a, b)
            inserted, deleted = inserted + len(b) - common, deleted + len(a) - common
        assert count(block, r'<span class="ins">') == inserted
        assert count(block, r'<span class="del">') == deleted


@browser
def test_served_page_shows_new_steps_as_the_run_writes_them(tmp_path):
    """`rollouts view --serve`: a page left open (driven over the DevTools protocol) lists the
    steps the run appends while it is open, and shows the newest."""
    from tests.viewer_helpers import DevToolsPage
    from training.viewer.serve import make_server

    run = write_synthetic_run(tmp_path / "run", steps=2)
    server = make_server(run, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    (tmp_path / "chromium").mkdir()
    browser_page = None
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        browser_page = DevToolsPage(f"http://{host}:{port}/", tmp_path / "chromium")
        rows = "document.querySelectorAll('#step-list tbody tr').length"
        browser_page.wait_for(f"{rows} === 2", timeout_s=30, what="the two steps of the run")
        (run / "rollouts.jsonl").unlink()  # the run goes on: 4 steps (a longer file, same start)
        (run / "metrics.jsonl").unlink()
        write_synthetic_run(run, steps=4)
        browser_page.wait_for(f"{rows} === 4", timeout_s=30, what="the steps written since")
        shown = browser_page.evaluate("document.getElementById('step-now').textContent")
        assert shown == "step 4"
        groups = browser_page.evaluate("document.querySelectorAll('div.group').length")
        assert groups == len(read_rollout_dump(run / "rollouts.jsonl")[4].groups)
        assert "· live" in browser_page.evaluate("document.getElementById('run-info').textContent")
        assert browser_page.problems == []
    finally:
        if browser_page is not None:
            browser_page.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# ----- SFT: held-out generations per evaluation -------------------------------------------------


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A 4-step SFT run of the tiny model on arithmetic, evaluated (greedy) at steps 2 and 4."""
    from training.config import SFTRunConfig, load_config
    from training.recipes.sft import run_sft_recipe

    tmp = tmp_path_factory.mktemp("viewer_sft")
    root = Path(__file__).resolve().parent.parent
    config = load_config(SFTRunConfig, root / "configs" / "sft_tiny.yaml", [
        f"output_dir={tmp / 'run'}", f"model.path={tiny_model_dir}",
        f"data.task_dir={tmp / 'data'}", "data.arithmetic.n_sft=200", "data.arithmetic.n_rl=16",
        "data.arithmetic.n_eval=16", "train.max_steps=4", "train.eval_every=2",
        "train.batch_size=8", "train.eval_samples=8", "train.greedy_eval_samples=6",
        "train.checkpoint_every=4", "backend.num_threads=1",
    ])  # fmt: skip
    trio.run(run_sft_recipe, config)
    build_site(tmp / "run")
    return tmp / "run"


@browser
def test_sft_page_shows_each_evaluations_generations_and_their_accuracy(sft_run):
    rows = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["accuracy"] for r in rows if "accuracy" in r}
    assert sorted(accuracy) == [2, 4]
    written = [
        json.loads(line) for line in (sft_run / "eval_generations.jsonl").read_text().splitlines()
    ]
    for step in (2, 4):
        dom, console = page(sft_run, f"#tab=sft&sft={step}")
        assert console == []
        prompts = re.findall(r'<div class="sft-row"[^>]*><div class="prompt">([^<]*)<', dom)
        assert prompts == [
            html.escape(r["prompt"], quote=False) for r in written if r["step"] == step
        ]
        assert count(dom, r'<div class="sft-row" data-correct="[01]">') == 6
        right = count(dom, r'<div class="sft-row" data-correct="1">')
        assert right == round(accuracy[step] * 6)
        assert f"held-out greedy generations at step {step}: {right} of 6 correct" in dom


# ----- the command and the reader, without a browser ---------------------------------------------


def test_view_command_writes_the_site_and_names_a_missing_run_dir(tmp_path, capsys):
    from training.recipes.cli import main

    run = write_synthetic_run(tmp_path / "run", steps=3)
    assert main(["view", str(run)]) == 0
    index = (run / "viewer" / "index.html").resolve()
    assert f"wrote {index} (3 steps); open file://{index}" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "viewer" / "data").iterdir()) == [
        "manifest.js", "step_000001.js", "step_000002.js", "step_000003.js"]  # fmt: skip
    assert main(["view", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "nowhere is not a directory" in err and "output_dir" in err


def test_a_step_being_written_is_shown_once_its_line_is_whole(tmp_path):
    """A live run's last line may be half written when the viewer reads: it waits for it."""
    from training.viewer.site import ViewerSite

    run = write_synthetic_run(tmp_path / "run", steps=2)
    dump = run / "rollouts.jsonl"
    lines = dump.read_bytes().splitlines(keepends=True)
    dump.write_bytes(lines[0] + lines[1][:100])
    site = ViewerSite(run)
    site.refresh()
    assert site.steps == [1]
    with dump.open("ab") as file:
        file.write(lines[1][100:])
    assert site.refresh() and site.steps == [1, 2]
    assert not site.refresh()  # nothing new: nothing rewritten


def test_a_malformed_dump_line_is_named_by_file_and_offset(tmp_path):
    from plumbing.errors import DataError
    from training.viewer.site import ViewerSite

    run = write_synthetic_run(tmp_path / "run", steps=1)
    size = (run / "rollouts.jsonl").stat().st_size
    with (run / "rollouts.jsonl").open("a") as file:
        file.write('{"groups": []}\n')
    with pytest.raises(DataError) as err:
        ViewerSite(run).refresh()
    assert f"rollouts.jsonl: the line at byte {size} is not a rollout dump record" in str(err.value)
    assert "train.dump_rollouts=true" in str(err.value)
