"""Our model implementations against Hugging Face transformers on the same checkpoints:
a packed prefill of several prompts in one forward over a shuffled paged KV cache, then a
decode step reading that cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels import AttentionMetadata, cpu_elementwise, get_attention_backend
from worker.models import SUPPORTED_ARCHITECTURES, load_model
from worker.models.rotary import inverse_frequencies, rope_parameters

BLOCK_SIZE = 4
PROMPT_LENS = (5, 11, 8)
BACKEND = get_attention_backend("torch", "cpu")


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype).eval()


def shuffled_block_tables(num_blocks_per_seq: list[int], seed: int = 0) -> list[list[int]]:
    """Non-contiguous, interleaved blocks, with spare blocks so ids are not dense."""
    pool = torch.randperm(sum(num_blocks_per_seq) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in num_blocks_per_seq:
        tables.append(pool[:n])
        pool = pool[n:]
    return tables


def run_step(model, new_tokens: list[list[int]], num_cached: list[int], tables: list[list[int]]) -> torch.Tensor:
    """One packed forward: sequence s appends new_tokens[s] after num_cached[s] cached
    tokens. Returns float32 logits for every packed token."""
    ids, positions, slots, starts = [], [], [], [0]
    for tokens, cached, table in zip(new_tokens, num_cached, tables):
        span = range(cached, cached + len(tokens))
        ids += tokens
        positions += span
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
        starts.append(starts[-1] + len(tokens))
    seq_lens = [c + len(t) for c, t in zip(num_cached, new_tokens)]
    width = max(map(len, tables))
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(map(len, new_tokens)),
        max_seq_len=max(seq_lens),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(positions), md)
        return model.compute_logits(hidden)


def bind_fresh_cache(model, num_blocks: int, dtype: torch.dtype) -> None:
    shape = (num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    # Poisoned so attending to any slot that was never written shows up in the logits
    # (finite: masked-out slots are multiplied by a zero probability, which NaN survives).
    model.bind_kv_caches(
        [(torch.full(shape, 1e3, dtype=dtype), torch.full(shape, 1e3, dtype=dtype))
         for _ in range(model.num_layers)]
    )


def prefill_then_decode(model_dir: Path, dtype: torch.dtype):
    """Our logits for the packed prefill [sum(PROMPT_LENS), V] and the decode step [3, V],
    with the prompts and the decoded tokens."""
    model = load_model(model_dir, dtype, torch.device("cpu"), BACKEND)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    next_tokens = torch.randint(3, model.vocab_size, (len(prompts),), generator=gen).tolist()
    tables = shuffled_block_tables([-(-(n + 1) // BLOCK_SIZE) for n in PROMPT_LENS])
    bind_fresh_cache(model, 1 + max(b for t in tables for b in t), dtype)
    prefill = run_step(model, prompts, [0] * len(prompts), tables)
    decode = run_step(model, [[t] for t in next_tokens], list(PROMPT_LENS), tables)
    return prefill, decode, prompts, next_tokens


def reference_logits(model_dir: Path, prompts, next_tokens, dtype: torch.dtype = torch.float32):
    ref = hf_model(model_dir, dtype)
    with torch.no_grad():
        prefill = torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts]).float()
        decode = torch.stack([ref(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(prompts, next_tokens)]).float()
    return prefill, decode


def assert_matches_hf(model_dir: Path) -> None:
    prefill, decode, prompts, next_tokens = prefill_then_decode(model_dir, torch.float32)
    ref_prefill, ref_decode = reference_logits(model_dir, prompts, next_tokens)
    scale = ref_prefill.abs().max()
    torch.testing.assert_close(prefill, ref_prefill, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(decode, ref_decode, rtol=1e-4, atol=1e-4 * scale)


def test_float32_logits_match_transformers(tiny_model_dir, tiny_arch):
    assert_matches_hf(tiny_model_dir(tiny_arch))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_transformers(tiny_model_dir, dtype):
    model_dir = tiny_model_dir("qwen3")  # q/k norms and rotary exercise the most half-precision code
    prefill, decode, prompts, next_tokens = prefill_then_decode(model_dir, dtype)
    ref_prefill, ref_decode = reference_logits(model_dir, prompts, next_tokens, dtype)
    scale = ref_prefill.abs().max()
    for ours, ref in ((prefill, ref_prefill), (decode, ref_decode)):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, ref, rtol=0, atol=0.02 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pytorch_elementwise_path_equals_the_cpu_kernels(tiny_model_dir, tiny_arch, dtype, monkeypatch):
    # The decoder's norms, rotary and SiLU-and-mul run as C++ kernels on the CPU and as
    # PyTorch ops elsewhere (a GPU, PAGEDQ_CPU_KERNEL=0); both give the same logits.
    model_dir = tiny_model_dir(tiny_arch)
    fused = prefill_then_decode(model_dir, dtype)[:2]
    monkeypatch.setattr(cpu_elementwise, "usable", lambda *tensors: False)
    plain = prefill_then_decode(model_dir, dtype)[:2]
    for ours, theirs in zip(fused, plain):
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours, theirs, rtol=0, atol=tolerance * theirs.abs().max())


def test_sharded_checkpoint_loads(tiny_model_dir):
    model_dir = tiny_model_dir("llama", max_shard_size="100KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_matches_hf(model_dir)


def test_tied_embeddings(tiny_model_dir):
    model_dir = tiny_model_dir("llama", tie_word_embeddings=True)
    model = load_model(model_dir, torch.float32, torch.device("cpu"), BACKEND)
    assert model.output_embedding() is model.model.embed_tokens.weight
    assert_matches_hf(model_dir)


def test_missing_lm_head_means_tied(tiny_model_dir, tmp_path):
    """A checkpoint without lm_head.weight ties it even if its config does not say so."""
    model_dir = shutil.copytree(tiny_model_dir("qwen2", tie_word_embeddings=True), tmp_path / "ckpt")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    model = load_model(model_dir, torch.float32, torch.device("cpu"), BACKEND)
    assert model.output_embedding() is model.model.embed_tokens.weight


def test_llama3_rope_scaling_matches_transformers(tiny_model_dir):
    rope_scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=64)
    model_dir = tiny_model_dir("llama", rope_scaling=rope_scaling, max_position_embeddings=256)
    model = load_model(model_dir, torch.float32, torch.device("cpu"), BACKEND)
    params = rope_parameters(model.hf_config)
    assert params["rope_type"] == "llama3"
    scaled = inverse_frequencies(params, model.head_dim)
    unscaled = inverse_frequencies({**params, "rope_type": "default"}, model.head_dim)
    # head_dim 16 with these thresholds puts frequencies in all three bands.
    assert (scaled == unscaled).any() and (scaled < unscaled / 7.9).any() and (scaled != unscaled).sum() > 1
    assert_matches_hf(model_dir)


def test_rope_settings_in_both_config_spellings():
    older = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(older) == {"type": "linear", "factor": 2.0, "rope_theta": 5e5, "rope_type": "linear"}
    newer = SimpleNamespace(rope_parameters={"rope_theta": 5e5, "rope_type": "default"}, rope_theta=1.0)
    assert rope_parameters(newer)["rope_theta"] == 5e5
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        rope_parameters(SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"}))


def test_unsupported_architecture_is_a_clear_error(tiny_model_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir("llama"), tmp_path / "ckpt")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ValueError, match="not supported") as excinfo:
        load_model(model_dir, torch.float32, torch.device("cpu"), BACKEND)
    assert all(name in str(excinfo.value) for name in SUPPORTED_ARCHITECTURES)


def test_missing_weights_are_reported(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(tiny_model_dir("llama"), tmp_path / "ckpt")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weights.*qkv_proj.weight\[1\]"):
        load_model(model_dir, torch.float32, torch.device("cpu"), BACKEND)
