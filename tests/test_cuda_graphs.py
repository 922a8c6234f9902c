"""Decode through CUDA-graph buffers: padded lanes (slot -1, context 0) change nothing.

On a CPU the padded static buffers run eagerly, which checks the padding; on a GPU the
captured graphs' replay must equal the eager forward."""

from __future__ import annotations

import pytest
import torch

from kernels import get_attention_backend
from worker.cuda_graphs import DecodeGraphs, bucket_sizes
from worker.models import load_model

BLOCK_SIZE = 16


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert bucket_sizes(256)[-3:] == [240, 248, 256]


def decode_batch(model, device, num_seqs: int, seed: int = 0):
    """A cache with random contents and `num_seqs` decodes over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 70, (num_seqs,), generator=gen).tolist()
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    pool = torch.randperm(sum(blocks_per_seq) + 4, generator=gen).tolist()
    tables = []
    for n in blocks_per_seq:
        tables.append(pool[:n])
        pool = pool[n:]
    shape = (sum(blocks_per_seq) + 4, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    caches = [(torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device)) for _ in range(model.num_layers)]
    model.bind_kv_caches(caches)
    ids = torch.randint(3, model.vocab_size, (num_seqs,), generator=gen).tolist()
    positions = [n - 1 for n in lens]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(tables, positions)]
    return ids, positions, slots, lens, tables, caches


def eager(model, device, ids, positions, slots, lens, tables):
    from kernels import AttentionMetadata

    width = max(map(len, tables))
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=max(lens),
    )
    return model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), md)


@torch.inference_mode()
def check_padded_decode(model_dir, device: torch.device, backend: str, capture: bool):
    model = load_model(model_dir, torch.float32, device, get_attention_backend(backend, device.type))
    ids, positions, slots, lens, tables, caches = decode_batch(model, device, num_seqs=5)
    graphs = DecodeGraphs(model, max_batch=16, max_blocks_per_seq=8, max_seq_len=128, device=device)
    if capture:
        graphs.capture()
    assert graphs.bucket(5) == 8
    before = [(k.clone(), v.clone()) for k, v in caches]
    width = max(map(len, tables))
    padded = graphs.run(
        torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), torch.tensor(lens, dtype=torch.int32),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
    )
    after_padded = [(k.clone(), v.clone()) for k, v in caches]
    for (k, v), (k0, v0) in zip(caches, before):
        k.copy_(k0)
        v.copy_(v0)
    want = eager(model, device, ids, positions, slots, lens, tables)
    torch.testing.assert_close(padded, want, atol=1e-4, rtol=1e-4)
    # Padded lanes stored nothing: the cache holds exactly what the eager step wrote.
    for (k, v), (kp, vp) in zip(caches, after_padded):
        torch.testing.assert_close(kp, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vp, v, atol=1e-5, rtol=1e-5)


def test_padded_lanes_change_nothing_on_cpu(tiny_model_dir):
    check_padded_decode(tiny_model_dir("llama"), torch.device("cpu"), "torch", capture=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_equals_eager(tiny_model_dir):
    check_padded_decode(tiny_model_dir("llama"), torch.device("cuda"), "triton", capture=True)
