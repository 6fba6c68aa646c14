"""Seed an offline Hugging Face cache so tinker-cookbook's recipes run unmodified without the Hub.

tinker-cookbook's `recipes/sl_loop.py` and `recipes/rl_loop.py` call
`get_tokenizer(model_name)` (`AutoTokenizer.from_pretrained`) and
`datasets.load_dataset("HuggingFaceH4/no_robots")` / `load_dataset("openai/gsm8k", "main")`,
all from the Hub. With no network, this writes, under HF_HOME:

- hub/models--<org>--<name>: the tiny model's tokenizer files under the HF id the recipe is
  given (`model_name=`), so `AutoTokenizer.from_pretrained(<HF id>)` loads the tiny tokenizer;
- the two datasets, as small synthetic stand-ins with the same columns (no_robots: `prompt`,
  `prompt_id`, `messages`, `category`; gsm8k: `question`, `answer` ending in `#### <n>`),
  saved into the datasets cache in the layout `load_dataset` reads back when HF_HUB_OFFLINE=1.

Run it with the cookbook's venv (it needs `datasets`):
  python benchmarks/cookbook_offline_hub.py --hf-home DIR --tokenizer-from runs/tiny_model \
      --model-name Qwen/Qwen3-4B-Instruct-2507
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from pathlib import Path

_COMMIT = "0" * 40  # the cache's snapshot name; any 40-hex string the refs point at
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "config.json", "generation_config.json")  # fmt: skip


def seed_tokenizer(hf_home: Path, model_name: str, source: Path) -> Path:
    """The tiny tokenizer under `model_name` in the Hub cache layout (refs/main -> snapshot)."""
    repo = hf_home / "hub" / ("models--" + model_name.replace("/", "--"))
    snapshot = repo / "snapshots" / _COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_COMMIT)
    for name in _TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, snapshot / name)
    return snapshot


def no_robots_rows(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        user = f"Write one short sentence about the sum of {a} and {b}."
        assistant = f"The sum of {a} and {b} is {a + b}."
        rows.append({"prompt": user, "prompt_id": f"{i:06d}", "category": "Generation",
                     "messages": [{"role": "user", "content": user},
                                  {"role": "assistant", "content": assistant}]})  # fmt: skip
    return rows


def gsm8k_rows(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"Tom has {a} apples and gets {b} more. How many apples "
                                 "does he have?",
                     "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n"
                               f"#### {a + b}"})  # fmt: skip
    return rows


def seed_dataset(hf_home: Path, repo_id: str, config: str | None, rows: list[dict]) -> None:
    """Write `rows` as `repo_id`'s train split where `load_dataset(repo_id, config)` looks when
    the Hub is unreachable (datasets' CachedDatasetModuleFactory: HF_HOME/datasets/
    <namespace>___<name>/<config>/<version>/<hash>/), prepared by the library's JSON builder."""
    import datasets
    from datasets.packaged_modules.json.json import Json

    data_dir = hf_home / "stand_in_data" / repo_id.replace("/", "__")
    data_dir.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_json(data_dir / "train.jsonl")
    builder = Json(cache_dir=str(data_dir / "build"), config_name=config or "default",
                   data_files={"train": str(data_dir / "train.jsonl")})  # fmt: skip
    builder.download_and_prepare()
    namespace, name = repo_id.split("/")
    target = hf_home / "datasets" / f"{namespace}___{name}" / (config or "default")
    target = target / str(builder.config.version) / _COMMIT
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(builder.cache_dir, target)
    for arrow in target.glob("json-*.arrow"):  # the reader asks for <name>-<split>.arrow
        arrow.rename(target / arrow.name.replace("json-", f"{name}-", 1))


def boxed_sft_rows(n: int, rng: random.Random) -> list[dict]:
    """Chats in rl_loop's prompt shape (its few-shot turn, kept as context with weight 0, then
    a stand-in question) answered `\\boxed{n}`: SFT on them gives rl_loop a base model that
    earns some reward (a random model never writes `\\boxed{`)."""
    suffix = " Provide a numerical answer without units, written inside \\boxed{}."
    shot = [{"role": "user", "content": "How many r's are in strawberry?" + suffix},
            {"role": "assistant", "weight": 0, "content": "Let's spell the word out and number "
             "all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. We have r's "
             "at positions 3, 8, and 9. \\boxed{3}"}]  # fmt: skip
    rows = []
    for row in gsm8k_rows(n, rng):
        answer = row["answer"].rsplit("#### ", 1)[1]
        rows.append({"messages": [*shot, {"role": "user", "content": row["question"] + suffix},
                                  {"role": "assistant", "content": f"\\boxed{{{answer}}}"}]})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-home", type=Path)
    parser.add_argument("--tokenizer-from", type=Path, help="the tiny model dir")
    parser.add_argument("--model-name", help="the HF id given as model_name=")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--boxed-sft", type=Path,
                        help="instead: write this SFT JSONL (2000 boxed-answer chats) and exit")  # fmt: skip
    args = parser.parse_args()
    if args.boxed_sft:
        args.boxed_sft.parent.mkdir(parents=True, exist_ok=True)
        with args.boxed_sft.open("w") as f:
            for row in boxed_sft_rows(2000, random.Random(1)):
                f.write(json.dumps(row) + "\n")
        print(f"wrote {args.boxed_sft}")
        return
    if not (args.hf_home and args.tokenizer_from and args.model_name):
        parser.error("--hf-home, --tokenizer-from and --model-name are needed (or --boxed-sft)")
    os.environ["HF_HOME"] = str(args.hf_home)
    rng = random.Random(0)
    snapshot = seed_tokenizer(args.hf_home, args.model_name, args.tokenizer_from)
    seed_dataset(args.hf_home, "HuggingFaceH4/no_robots", None, no_robots_rows(args.rows, rng))
    seed_dataset(args.hf_home, "openai/gsm8k", "main", gsm8k_rows(args.rows, rng))
    print(f"seeded {args.hf_home}: tokenizer {args.model_name} -> {snapshot}")


if __name__ == "__main__":
    main()
