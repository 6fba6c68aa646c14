"""Build a tiny, randomly initialised HF causal LM and a tokenizer, offline.

No model hub is reachable on the machines this project is tested on, so tests, the demo and the
benchmarks use a model built here. The output directory is a normal HF model directory
(`config.json`, `model.safetensors`, tokenizer files, chat template): `AutoModelForCausalLM` and
`AutoTokenizer.from_pretrained(dir)` load it unchanged, and it is what an inference server is
started on.

The tokenizer is a byte-level BPE trained on a fixed corpus (so it is identical for every seed):
any text round-trips through bytes, every digit is its own token, and the ChatML special tokens
plus a Hermes/Qwen-style tool-call chat template are included. Only the weights depend on `seed`.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

from training.backend.hf_progress import hf_progress_bars_off

Size = Literal["tiny", "small"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# ChatML with optional tools (Qwen/Hermes style). Newlines are written as {{ '\n' }} expressions
# because the template renderer drops a literal newline right after a {% %} tag.
_TOOLS_HEADER = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- 'Tools:' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- \'\\nCall a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>\''
    " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
)
_TOOL_CALLS = (
    "{%- if message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    '{{- \'<tool_call>{"name": "\' + fn.name + \'", "arguments": \' -}}'
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
)
CHAT_TEMPLATE = (
    _TOOLS_HEADER + "{%- for message in messages -%}"
    "{%- if message.role == 'system' and tools and loop.first -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}"
    + _TOOL_CALLS
    + "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The same, with Qwen3's thinking rules (what its template does, reduced to this vocabulary): an
# assistant turn's `<think>...</think>` block is split from its content and kept only for turns
# after the last user message; the last assistant turn always carries one (empty without
# reasoning); `enable_thinking=False` writes the empty block in the generation prompt. So the
# history renders differently once more messages follow (no longer last: the empty block goes;
# a new user turn: earlier reasoning goes), as with Qwen3: multi-turn rollouts branch there.
QWEN3_STYLE_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}" + _TOOLS_HEADER + "{%- for message in messages -%}"
    "{%- if message.role == 'system' and tools and loop.first -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set content = message.content or '' -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- content -}}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)
CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "qwen3": QWEN3_STYLE_CHAT_TEMPLATE}

_ARCH = {
    # ~3.0 M parameters: fast enough to train to useful accuracy on 2 CPU cores in minutes.
    "tiny": dict(
        hidden_size=192, intermediate_size=768, num_hidden_layers=5, num_attention_heads=6
    ),
    # ~25 M parameters: for throughput benchmarks closer to real workloads.
    "small": dict(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8
    ),
}


def _tokenizer_corpus() -> list[str]:
    """A fixed, deterministic corpus: ASCII, arithmetic, chat and tool-call text."""
    words = (
        "the of and to in is it that for you was with on as have be at one this what are "
        "from or had by not but some they we can out other were all there when up use your how "
        "said an each she which do their time if will way about many then them would write like "
        "so these her long make thing see him two has look more day could go come did number "
        "sound no most people my over know water than call first who may down side been now find "
        "answer question result sum difference product add subtract multiply divide equals "
        "calculator python code tool error true false none name arguments output user assistant "
        "system def return print import"
    ).split()
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    lines += [string.ascii_letters, string.punctuation, string.digits]
    lines += [f"{a}+{b}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 9)]
    lines += [f"{a}-{b}={a - b}" for a in range(0, 100, 9) for b in range(0, 100, 7)]
    lines += [f"{a}*{b}={a * b}" for a in range(0, 50, 7) for b in range(0, 50, 9)]
    lines += ['{"name": "calculator", "arguments": {"expression": "12*34"}}'] * 5
    # Chat roles become single tokens, so a chat turn costs few tokens (faster training).
    lines += ["system", "user", "assistant", "tool"] * 200
    return lines


def build_tokenizer(model_max_length: int = 1024, template: str = "chatml"):
    """Train the byte-level BPE tokenizer and wrap it as a `PreTrainedTokenizerFast`
    (`template`: a key of `CHAT_TEMPLATES`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATES[template],
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(output_dir: str | Path, *, seed: int = 0, size: Size = "tiny",
                     template: str = "chatml") -> Path:  # fmt: skip
    """Write a randomly initialised Llama-class model plus tokenizer to `output_dir`.

    Args:
        output_dir: directory to create (or overwrite) with an HF model.
        seed: seed for the weight initialisation; the tokenizer does not depend on it.
        size: "tiny" (~3 M params) or "small" (~25 M params).
        template: the chat template, "chatml" or "qwen3" (Qwen3's thinking rules, which
            re-render earlier turns: `QWEN3_STYLE_CHAT_TEMPLATE`).

    Returns:
        The output directory as a Path.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if size not in _ARCH:
        raise ValueError(f"size must be one of {sorted(_ARCH)}, got {size!r}")
    if template not in CHAT_TEMPLATES:
        raise ValueError(f"template must be one of {sorted(CHAT_TEMPLATES)}, got {template!r}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(template=template)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        rope_theta=10000.0,
        # Untied: with tied input/output embeddings, GRPO steps on this tiny model moved the
        # answer digits' input representations too and lowered held-out accuracy at every
        # learning rate tried; untied, the same recipe gains 10+ points (benchmarks/RESULTS.md,
        # "How the demo's settings were chosen").
        tie_word_embeddings=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_dropout=0.0,
        **_ARCH[size],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=pad_id
    )
    with hf_progress_bars_off():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ensure_tiny_model(output_dir: str | Path, *, seed: int = 0, size: Size = "tiny") -> Path:
    """Build the tiny model at `output_dir` unless a complete one is already there."""
    out = Path(output_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    return build_tiny_model(out, seed=seed, size=size)
