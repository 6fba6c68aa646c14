import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.backend.tiny_model import build_tokenizer


def test_auto_classes_load_the_directory_unchanged(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_000_000 <= n_params <= 5_000_000
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id
    assert (tiny_model_dir / "model.safetensors").is_file()


def test_seeds_change_weights_not_tokenizer(tiny_model_dir, tiny_model_dir_seed1):
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    b = AutoModelForCausalLM.from_pretrained(tiny_model_dir_seed1)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    ta = AutoTokenizer.from_pretrained(tiny_model_dir)
    tb = AutoTokenizer.from_pretrained(tiny_model_dir_seed1)
    assert ta.get_vocab() == tb.get_vocab()


def test_tokenizer_round_trips_text_and_splits_digits():
    tok = build_tokenizer()
    text = "Ünïcode 123+45=168 <tag> \n\tend"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("9876")["input_ids"]) == ["9", "8", "7", "6"]


def test_chat_template_renders_chatml_with_generation_prompt(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n"
