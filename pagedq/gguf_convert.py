"""GGUF file → an ordinary Hugging Face checkpoint directory that pagedq (and transformers) load.

transformers reads the GGUF (config, tokenizer with its chat template, weights dequantized
by the `gguf` package, llama.cpp's rotary permutation of q/k undone) but marks the model it
returns as quantized, and such a model refuses `save_pretrained`. So the weights are moved
into a fresh model built from the same config without `quantization_config`, and that one is
saved: safetensors in the chosen dtype, config.json, generation_config.json, tokenizer.json
and the tokenizer config holding the chat template.
"""

from __future__ import annotations

from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype: one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    # Dequantized straight to float32 (its tqdm bar shows the progress), cast once below.
    quantized = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    config.dtype = torch_dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    # strict: every parameter of the fresh model must come from the file (tied ones included).
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
