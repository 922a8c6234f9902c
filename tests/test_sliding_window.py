"""Sliding-window attention: a query at position p sees keys p - W + 1 .. p only.

One mask term in every attention implementation (the reference, the CPU torch path, the
Triton kernel, whose interpreter run is in test_triton_kernels.py), and a per-layer window
read from the Hugging Face config. The model tests compare greedy generation with
transformers past the window, with prefix caching and chunked prefill on.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig

from kernels.reference import paged_attention_reference
from kernels import get_attention_backend
from pagedq import LLM, SamplingParams
from pagedq.bench.kernels import AttentionShape, random_paged_batch
from worker.models.decoder import layer_sliding_windows

WINDOW = 32
# A full prefill, decodes before / at / past the window, a chunk after a cached prefix
# that straddles the window's edge, a prefill longer than the window.
Q_LENS = [7, 1, 1, 1, 20, 1, 50]
SEQ_LENS = [7, 31, 32, 90, 70, 33, 50]


def dense_windowed_attention(batch, scale: float, window: int) -> torch.Tensor:
    """Attention written out per query from the unpaged keys: the definition."""
    out = torch.zeros_like(batch.query)
    starts = batch.query_start_loc.tolist()
    block_size = batch.key_cache.shape[1]
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[s, : -(-seq_len // block_size)].long()
        keys = batch.key_cache[blocks].flatten(0, 1)[:seq_len].float()  # [C, KVH, D]
        values = batch.value_cache[blocks].flatten(0, 1)[:seq_len].float()
        q_len = starts[s + 1] - starts[s]
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = max(0, pos - window + 1)
            q = batch.query[starts[s] + i].float()  # [H, D]
            group = q.shape[0] // keys.shape[1]
            k = keys[lo : pos + 1].repeat_interleave(group, dim=1)  # [c, H, D]
            v = values[lo : pos + 1].repeat_interleave(group, dim=1)
            probs = (torch.einsum("hd,chd->hc", q, k) * scale).softmax(-1)
            out[starts[s] + i] = torch.einsum("hc,chd->hd", probs, v).to(out.dtype)
    return out


def make_batch(seed: int = 0):
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=64)
    return random_paged_batch(Q_LENS, SEQ_LENS, shape, block_size=16, unused_value=50.0, seed=seed)


def test_reference_equals_the_definition_and_differs_from_full_attention():
    batch = make_batch()
    args = batch.attention_args()
    scale = args[6]
    windowed = paged_attention_reference(*args, sliding_window=WINDOW)
    torch.testing.assert_close(windowed, dense_windowed_attention(batch, scale, WINDOW), atol=2e-5, rtol=1e-5)
    full = paged_attention_reference(*args)
    torch.testing.assert_close(full, dense_windowed_attention(batch, scale, 10**6), atol=2e-5, rtol=1e-5)
    # Rows whose context fits in the window are unchanged; the others are not.
    rows_past_window = [start + i for start, q, n in zip(batch.query_start_loc.tolist(), Q_LENS, SEQ_LENS)
                        for i in range(q) if n - q + i >= WINDOW]
    inside = [r for r in range(batch.query.shape[0]) if r not in rows_past_window]
    assert torch.equal(windowed[inside], full[inside])
    assert not torch.allclose(windowed[rows_past_window], full[rows_past_window], atol=1e-3)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [1, 5, WINDOW, 200])
def test_cpu_paths_match_reference(window, backend):
    """Both CPU backends: the C++ kernel's raised lower bound (and its skipped blocks) and the PyTorch path's mask."""
    paged_attention = get_attention_backend(backend, "cpu").paged_attention
    batch = make_batch(seed=window)
    got = paged_attention(*batch.attention_args(), sliding_window=window)
    torch.testing.assert_close(got, paged_attention_reference(*batch.attention_args(), sliding_window=window), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("model_type", "config", "expected"),
    [
        ("mistral", dict(sliding_window=WINDOW), [WINDOW] * 3),
        ("mistral", dict(sliding_window=None), [None] * 3),
        ("qwen2", dict(use_sliding_window=False, sliding_window=WINDOW), [None] * 3),
        ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), [None, WINDOW, WINDOW]),
        ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0), [WINDOW] * 3),
        ("llama", {}, [None] * 3),
    ],
)
def test_each_layer_window_is_read_from_the_config_as_transformers_does(model_type, config, expected):
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=3, **config)
    assert layer_sliding_windows(cfg) == expected


MODELS = {
    "mistral": dict(sliding_window=WINDOW),
    # Layer 0 attends fully, layer 1 through the window (max_window_layers).
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}
MAX_NEW_TOKENS = 24


def hf_greedy(model_dir, prompts: list[list[int]], **config_overrides) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config_overrides).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_greedy_equals_transformers_past_the_window(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch, **MODELS[arch])
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    # Two prompts share 40 tokens (prefix-cache hits); every sequence ends past the window.
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (9, 23)] + [[rng.randrange(3, 500) for _ in range(20)]]
    # 16-token steps: prompts are prefilled in chunks, some straddling the window's edge.
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=True, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = hf_greedy(model_dir, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.stats()["prefix_cache_hits"] > 0
    # The window changes what the model generates, so the comparison above could fail.
    no_window = dict(sliding_window=None) if arch == "mistral" else dict(use_sliding_window=False, layer_types=["full_attention"] * 2)
    assert hf_greedy(model_dir, prompts, **no_window) != expected
