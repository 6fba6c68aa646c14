"""README.md and docs/*.md: every Python snippet runs; every command a shell snippet names exists.

Why: the docs are the first code a user runs; a snippet that no longer runs, or a command or
config key that was renamed, is a defect a reader finds before we do. The conventions a docs
writer follows, all enforced here:

- A ```python block is a whole program. The test writes it to a file and runs it as `python
  snippet.py` in a fresh temporary directory (its cwd), with `SNIPPET_TIMEOUT_S` as deadline;
  it must exit 0. Its process is forked from a warm interpreter that has torch and
  transformers imported (tests/warm_python.py: ~3 CPU s less per snippet). `runs/tiny_model` is already there (a copy of the session's tiny model), so a
  snippet that calls `ensure_tiny_model("runs/tiny_model")` does not spend time building it.
- To run a long snippet small, end a line with `# docs-test: NAME=VALUE [NAME=VALUE ...]`:
  before running, the value of `NAME = <old>` (or `NAME=<old>`) on that line becomes VALUE (the
  old value ends at a comma, `)`, a quote or a space). The reader sees the real setting
  (`steps = 50  # docs-test: steps=2`). Put the marker on a short assignment that ruff's
  formatter keeps on one line (snippets are ruff-formatted with the rest of the code); a marker
  whose NAME is not on its line fails the test, so markers cannot go stale.
- `<!-- docs-test: skip (REASON) -->` on the line right before a block skips it (it needs a
  GPU or a live SGLang server). At most `MAX_SKIPS` blocks in all the docs may be skipped.
- ```bash blocks are not run. Every `rollouts SUBCOMMAND` in them must be a command of the CLI
  (`training.recipes.cli.COMMANDS`), every `make TARGET` a Makefile target, every `configs/`,
  `examples/` or `benchmarks/` path a file, and the dotted overrides of a run command
  (`rollouts sft|rl`, `examples/run_*.py`) with `--config configs/X.yaml` must load with X.
- A ```yaml block must validate as an RL or an SFT run config (fragments are fine: every field
  has a default), so a documented key cannot be misspelt; a ```json block is JSON lines.
  A ```yml block is a config of another framework (docs/from-trl.md's TRL recipe): not checked
  here, but by the page's own tests below.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET_TIMEOUT_S = 600
MAX_SKIPS = 3
README_MAX_LINES = 200

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+?)\)\s*-->\s*$")
MARKER = re.compile(r"\s*#\s*docs-test:\s*(.+)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is (`file:line` of its fence), its language and text."""

    path: Path
    line: int
    lang: str
    text: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def blocks(lang: str, paths: list[Path] = DOCS) -> list[Block]:
    """Every fenced block of `lang` in `paths` (default: the docs), in file order."""
    found = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(1) != lang:
                continue
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            found.append(Block(path, line, lang, m.group(2), skip.group(1) if skip else None))
    return found


def apply_markers(block: Block) -> str:
    """The snippet as the test runs it: every `# docs-test: NAME=VALUE` substitution made.

    Raises:
        AssertionError: a marker names an argument its line does not have.
    """
    out = []
    for i, line in enumerate(block.text.splitlines(), start=1):
        marker = MARKER.search(line)
        if marker:
            line = line[: marker.start()]
            for pair in marker.group(1).split():
                name, _, value = pair.partition("=")
                pattern = rf"(\b{re.escape(name)}\s*=\s*)[^,)\s\"']+"
                line, n = re.subn(pattern, lambda m, v=value: m.group(1) + v, line)
                assert n == 1, f"{block.where}+{i}: docs-test marker {pair!r}: no {name}= here"
        out.append(line)
    return "\n".join(out) + "\n"


PYTHON_BLOCKS = blocks("python")


@pytest.fixture
def snippet_dir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    shutil.copytree(tiny_model_dir, tmp_path / "runs" / "tiny_model")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_python_snippet_runs(block: Block, snippet_dir: Path, warm_python) -> None:
    if block.skip_reason:
        pytest.skip(f"{block.where}: {block.skip_reason}")
    program = snippet_dir / "snippet.py"
    program.write_text(apply_markers(block), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # `python snippet.py` in its own process, forked from a warm interpreter (tests/warm_python.py)
    proc = warm_python.run([program], cwd=snippet_dir, env=env, timeout=SNIPPET_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{block.where}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def test_docs_have_python_snippets_and_few_are_skipped() -> None:
    skipped = [f"{b.where} ({b.skip_reason})" for b in PYTHON_BLOCKS if b.skip_reason]
    assert len(PYTHON_BLOCKS) >= 5, "the docs lost their runnable snippets"
    assert len(skipped) <= MAX_SKIPS, f"too many skipped snippets: {skipped}"


def test_docs_test_markers_match_their_lines() -> None:
    for block in PYTHON_BLOCKS:
        apply_markers(block)  # raises on a marker whose argument is not on its line


def test_markers_substitute_and_skips_are_read(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: skip (needs a CUDA GPU) -->\n```python\nprint(1)\n```\n\n"
        "```python\nsteps = 50  # docs-test: steps=2\nf(max_steps=steps, lr=1e-3)\n```\n"
        "```python\nx = g(n=3)  # docs-test: steps=2\n```\n"
    )
    skipped, run, stale = blocks("python", [page])
    assert skipped.skip_reason == "needs a CUDA GPU" and run.skip_reason is None
    assert apply_markers(run) == "steps = 2\nf(max_steps=steps, lr=1e-3)\n"
    with pytest.raises(AssertionError, match="no steps= here"):
        apply_markers(stale)


# ----- shell commands -------------------------------------------------------------------------


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """Logical lines of a bash block (`\\` continuations joined, comments dropped), numbered."""
    lines, pending, start = [], "", 0
    for i, raw in enumerate(block.text.splitlines()):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not pending:
            start = i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append((block.line + 1 + start, pending + line))
        pending = ""
    return [(n, line) for n, line in lines if line.strip()]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


BASH_BLOCKS = blocks("bash")


def test_bash_snippets_name_only_existing_commands_targets_and_files() -> None:
    from training.recipes.cli import COMMANDS

    targets = makefile_targets()
    problems = []
    for block in BASH_BLOCKS:
        for n, line in shell_lines(block):
            where = f"{block.path.relative_to(ROOT)}:{n}"
            for sub in re.findall(r"(?<![\w/.-])rollouts\s+([\w-]+)", line):
                if sub not in COMMANDS:
                    problems.append(f"{where}: `rollouts {sub}` is not a command")
            for args in re.findall(r"(?<![\w/.-])make\s+([^;&|]*)", line):
                for word in shlex.split(args):
                    if "=" in word or word.startswith("-"):
                        continue
                    if word not in targets:
                        problems.append(f"{where}: `make {word}` is not a Makefile target")
            for path in re.findall(r"(?<![\w/.-])((?:configs|examples|benchmarks)/[\w./-]+)", line):
                if not (ROOT / path).exists():
                    problems.append(f"{where}: {path} does not exist")
    assert not problems, "\n".join(problems)


def run_config_class(line: str):
    """The run config a command line loads, or None when it is not an SFT or RL run."""
    from training import RLRunConfig, SFTRunConfig

    if re.search(r"rollouts\s+sft|run_sft\.py", line):
        return SFTRunConfig
    if re.search(r"rollouts\s+rl|run_rl\.py|run_tool_rl\.py", line):
        return RLRunConfig
    return None


def test_bash_snippets_overrides_are_config_keys() -> None:
    from training import load_config

    checked, problems = 0, []
    for block in BASH_BLOCKS:
        for n, line in shell_lines(block):
            cls = run_config_class(line)
            config = re.search(r"--config\s+(\S+)", line)
            if cls is None or config is None:
                continue
            words = shlex.split(line)
            overrides = [w for w in words if re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+=.*", w)]
            try:
                load_config(cls, ROOT / config.group(1), overrides)
                checked += 1
            except Exception as err:
                problems.append(f"{block.path.relative_to(ROOT)}:{n}: {err}")
    assert not problems, "\n".join(problems)
    assert checked >= 5, "no run command with --config was found to check"


@pytest.mark.parametrize("block", blocks("yaml"), ids=lambda b: b.where)
def test_yaml_snippet_is_a_run_config(block: Block) -> None:
    from training import RLRunConfig, SFTRunConfig
    from training.config import build_config

    data = yaml.safe_load(block.text)
    errors = []
    for cls in (RLRunConfig, SFTRunConfig):
        try:
            build_config(cls, data, source=block.where)
            return
        except Exception as err:
            errors.append(str(err))
    pytest.fail("\n".join(errors))


@pytest.mark.parametrize("block", blocks("json"), ids=lambda b: b.where)
def test_json_snippet_is_json_lines(block: Block) -> None:
    for i, line in enumerate(block.text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                pytest.fail(f"{block.where}+{i}: not JSON: {err}")


# ----- the pages themselves -------------------------------------------------------------------


def test_readme_is_short_and_lists_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    for page in DOCS[1:]:
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_relative_links_point_at_files() -> None:
    problems = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            if not (path.parent / target).exists():
                problems.append(f"{path.relative_to(ROOT)}: link to {target} does not exist")
    assert not problems, "\n".join(problems)


# ----- docs/from-trl.md: the same mapping as the code's, and what a TRL config is told ----------

FROM_TRL = ROOT / "docs" / "from-trl.md"


def from_trl_doc_tables() -> dict[str, list[tuple[str, tuple[str, ...], str]]]:
    """The page's tables: TRL class (its `### Name` heading) -> (TRL key, rollouts keys, how)."""
    tables: dict[str, list[tuple[str, tuple[str, ...], str]]] = {}
    current = None
    for line in FROM_TRL.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^###\s+(\w+)", line)
        if heading:
            current = tables.setdefault(heading.group(1), [])
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is None or not line.startswith("| `") or len(cells) != 3:
            continue
        ours = tuple(re.findall(r"`([^`]+)`", cells[1]))
        current.append((cells[0].strip("`"), ours, cells[2]))
    return tables


def test_from_trl_tables_list_the_same_pairs_as_the_code_table() -> None:
    from training.trl_names import TRL_TABLES

    doc = from_trl_doc_tables()
    code = {t: [(e.trl, e.ours, e.note) for e in entries] for t, entries in TRL_TABLES.items()}
    assert sorted(doc) == sorted(code)
    for table in code:
        assert doc[table] == code[table], table


def test_from_trl_example_gets_the_rollouts_name_of_every_key(tmp_path: Path) -> None:
    from plumbing.errors import ConfigError
    from training import RLRunConfig, load_config

    (trl,) = blocks("yml", [FROM_TRL])
    path = tmp_path / "grpo.yaml"
    path.write_text(trl.text, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(RLRunConfig, path)
    lines = [line.strip() for line in str(err.value).splitlines()[1:]]
    keys = [line.split(":")[0] for line in trl.text.splitlines() if line and line[0] != " "]
    assert len(lines) == len(keys) - 1  # output_dir is a rollouts key too
    hints = ("rollouts calls it", "has no rollouts equivalent")
    assert all(any(h in line for h in hints) for line in lines), "\n".join(lines)
    # the output the page shows is the output a reader gets
    shown = next(b for b in blocks("text", [FROM_TRL]) if "unknown key" in b.text)
    for line in shown.text.splitlines()[1:]:
        assert line.strip().replace("grpo.yaml", str(path), 1) in lines, line
