"""Random-weight checkpoints: tokenizer coverage and round-trips, determinism, presets and
the `make-tiny-model` command."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from pagedq.cli import CommandError
from pagedq.commands import make_tiny_model as command
from pagedq.tiny_model import PRESETS, make_tiny_model


def test_tokenizer_covers_vocab_and_round_trips_utf8(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    assert len(tokenizer) == config.vocab_size
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        config.pad_token_id, config.bos_token_id, config.eos_token_id,
    )
    text = "Hello, wörld! 你好 🙂 tabs\tand\nnewlines  "
    ids = tokenizer.encode(text)
    assert tokenizer.bos_token_id not in ids and max(ids) < config.vocab_size
    assert tokenizer.decode(ids) == text
    decoded = tokenizer.decode(list(range(config.vocab_size)), skip_special_tokens=True)
    assert len(decoded) > config.vocab_size  # every id decodes to at least one character


def test_chat_template_marks_roles_and_ends_turns_with_eos(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.eos_token_id) == 2


def test_weights_follow_the_seed(tiny_model_dir, tmp_path):
    first = load_file(tiny_model_dir("qwen2") / "model.safetensors")
    again = load_file(make_tiny_model(tmp_path / "same", "qwen2") / "model.safetensors")
    other = load_file(make_tiny_model(tmp_path / "other", "qwen2", seed=1) / "model.safetensors")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])
    # Biases and norm weights are randomised too, so ignoring one is visible in tests.
    assert first["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    assert not torch.equal(first["model.norm.weight"], torch.ones_like(first["model.norm.weight"]))


def test_dtype_and_config_overrides(tmp_path):
    model_dir = make_tiny_model(tmp_path, "gpt2", dtype="bfloat16", n_layer=1, vocab_size=300)
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["n_layer"], config["vocab_size"], config["architectures"]) == (1, 300, ["GPT2LMHeadModel"])
    assert {t.dtype for t in load_file(model_dir / "model.safetensors").values()} == {torch.bfloat16}
    assert len(AutoTokenizer.from_pretrained(model_dir)) == 300


@pytest.mark.parametrize(
    "preset, arch, params_millions",
    [("bench-56m", "llama", 56), ("qwen2.5-0.5b", "qwen2", 494), ("llama-3.2-1b", "llama", 1236)],
)
def test_presets_have_the_real_shapes(preset, arch, params_millions):
    import transformers

    from pagedq.model_info import ARCHITECTURE_BY_MODEL_TYPE

    spec = PRESETS[preset]
    model_class = getattr(transformers, ARCHITECTURE_BY_MODEL_TYPE[arch])
    config = model_class.config_class(**spec.shape.config_kwargs(arch), **spec.extra_config)
    with torch.device("meta"):
        model = model_class(config)
    unique = {p.data_ptr() if p.device.type != "meta" else id(p): p for p in model.parameters()}
    assert spec.arch == arch
    assert round(sum(p.numel() for p in unique.values()) / 1e6) == params_millions


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(arch="bert"), "arch must be one of"),
        (dict(preset="gpt-5"), "preset must be one of"),
        (dict(arch="gpt2", preset="bench-56m"), "preset 'bench-56m' is a llama model"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(vocab_size=100), "vocab_size must be at least 259"),
    ],
)
def test_bad_arguments_are_value_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path, **kwargs)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedq")
    command.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["make-tiny-model", *argv])


def test_command_writes_a_resized_checkpoint(tmp_path, capsys):
    args = _parse([str(tmp_path), "--arch", "qwen3", "--num-layers", "1", "--hidden-size", "32", "--seed", "3"])
    assert args.handler(args) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (1, 32, 8)
    assert "wrote qwen3 checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-heads", "3"], "hidden_size \\(64\\) must split into num_heads \\(3\\)"),
        (["--arch", "gpt2", "--num-kv-heads", "2"], "GPT-2 has no grouped KV heads"),
        (["--num-layers", "0"], "num_layers must be at least 1"),
    ],
)
def test_command_reports_bad_shapes(tmp_path, argv, message):
    args = _parse([str(tmp_path), *argv])
    with pytest.raises(CommandError, match=message):
        args.handler(args)
