"""Turns a scheduled step into one forward pass: runs the step's block copies and swaps,
packs every scheduled sequence's new tokens into flat tensors, runs the model over the
paged KV cache it owns, and returns the logits of the sequences that sample this step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata, get_attention_backend
from pagedq.config import EngineArgs
from scheduler import SchedulerOutput
from worker.cuda_graphs import DecodeGraphs
from worker.host_threads import limit_host_threads_for_gpu
from worker.kv_cache import KVCache, kv_cache_dtype
from worker.models import load_model
from worker.models.stub import StubForward

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was requested but no CUDA device is available")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return device


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {name!r}")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    checkpoint = _DTYPES.get(str(checkpoint).removeprefix("torch."), torch.bfloat16)
    return torch.bfloat16 if checkpoint == torch.float32 else checkpoint


@dataclass
class StepInputs:
    """One step packed on the host: every scheduled sequence's new tokens back to back, as
    CPU tensors built with a few tensor ops per step (no Python loop over tokens)."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slots: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, widest table]
    # Rows of the packed tokens whose logits are wanted (the last token of each sampling sequence).
    logits_indices: torch.Tensor  # int64
    max_query_len: int
    max_seq_len: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(cls, token_ids: list[int], starts: list[int], query_lens: list[int], block_tables: list[list[int]],
              sampling: list[bool], block_size: int) -> StepInputs:
        """Sequence s contributes `query_lens[s]` tokens from position `starts[s]`;
        `token_ids` holds them all, back to back."""
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        ends = torch.tensor(starts, dtype=torch.int64) + q_lens
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # Token i of sequence s sits at position ends[s] - (query_start_loc[s + 1] - i).
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens, output_size=num_tokens)
        positions = torch.arange(num_tokens) + (ends - query_start_loc[1:])[seq_of_token]
        blocks = tables[seq_of_token, positions // block_size].long()
        return cls(
            input_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=positions,
            slots=blocks * block_size + positions % block_size,
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=ends.to(torch.int32),
            block_tables=tables,
            logits_indices=query_start_loc[1:][torch.tensor(sampling, dtype=torch.bool)] - 1,
            max_query_len=max(query_lens),
            max_seq_len=max(s + n for s, n in zip(starts, query_lens)),
        )


def pack_step(out: SchedulerOutput, block_tables: list[list[int]], block_size: int) -> StepInputs:
    token_ids: list[int] = []
    for item in out.scheduled:
        start = item.seq.num_computed_tokens
        token_ids += item.seq.token_ids[start : start + item.num_new_tokens]
    return StepInputs.build(
        token_ids,
        [item.seq.num_computed_tokens for item in out.scheduled],
        [item.num_new_tokens for item in out.scheduled],
        block_tables,
        [item.completes_prompt for item in out.scheduled],
        block_size,
    )


class ModelRunner:
    def __init__(self, args: EngineArgs, hf_config, max_model_len: int):
        self.args = args
        self.device = resolve_device(args.device)
        if self.device.type == "cuda":
            limit_host_threads_for_gpu()
        self.dtype = resolve_dtype(args.dtype, hf_config, self.device)
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.attention = get_attention_backend(args.attention_backend, self.device.type)
        self.model = load_model(args.model, self.dtype, self.device, self.attention)
        if args.stub_forward:
            self.model = StubForward(self.model)
        self.vocab_size = self.model.vocab_size
        # Eager until captured: sizing the cache on CUDA runs a forward first.
        self.graphs: DecodeGraphs | None = None
        self.step_timings = None
        self.cache_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.kv_cache = KVCache.for_model(self.model, self.block_size, self.cache_dtype, self._decide_num_blocks(), self.device)
        self.kv_cache.bind(self.model)
        self.num_blocks = self.kv_cache.num_blocks
        self.num_cpu_blocks = 0
        if args.preemption_mode == "swap":
            self.num_cpu_blocks = int(args.swap_space_bytes // self.kv_cache.bytes_per_block)
            self.kv_cache.allocate_swap_space(self.num_cpu_blocks)
        self.graphs = self._capture_decode_graphs()
        logger.info(
            "model on %s (%s), attention %s, KV cache %d blocks x %d tokens (%s), swap %d blocks, CUDA graphs: %s",
            self.device, self.dtype, self.attention.name, self.num_blocks, self.block_size, self.cache_dtype,
            self.num_cpu_blocks, self.graphs.sizes if self.graphs else "off",
        )

    # --- KV cache sizing ----------------------------------------------------------------

    def _decide_num_blocks(self) -> int:
        if self.args.num_gpu_blocks_override is not None:
            return self.args.num_gpu_blocks_override
        bytes_per_block = KVCache.block_bytes(self.model, self.block_size, self.cache_dtype)
        if self.device.type == "cuda":
            budget = self._free_cuda_bytes_for_cache()
        else:
            budget = self.args.cpu_kv_cache_bytes
        # More blocks than every admitted sequence at full length could use is wasted memory.
        useful = self.args.max_num_seqs * -(-self.max_model_len // self.block_size)
        num_blocks = min(budget // bytes_per_block, useful)
        if num_blocks < 1:
            raise ValueError("the KV cache budget is too small for a single block")
        return int(num_blocks)

    def _free_cuda_bytes_for_cache(self) -> int:
        """Device memory left for the cache after the weights, the activations of the
        largest step (measured by running it once on a throwaway cache) and the sampler's
        full-vocabulary rows."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.args.max_num_batched_tokens, self.max_model_len)
        scratch_blocks = -(-num_tokens // self.block_size)
        scratch = KVCache.for_model(self.model, self.block_size, self.cache_dtype, scratch_blocks, self.device)
        scratch.bind(self.model)
        inputs = StepInputs.build(
            [0] * num_tokens, [0], [num_tokens], [list(range(scratch_blocks))], [True], self.block_size
        )
        self._forward(inputs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        self.model.bind_kv_caches([(None, None)] * self.model.num_layers)
        torch.cuda.empty_cache()
        # Logits, probabilities and noise of a full batch of sampling rows, in float32.
        sampler_bytes = 4 * self.args.max_num_seqs * self.vocab_size * 4
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, int(total * self.args.gpu_memory_utilization) - peak - sampler_bytes)

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        if self.device.type != "cuda" or self.args.enforce_eager or self.attention.name != "triton" or self.args.stub_forward:
            return None
        max_blocks = -(-self.max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, self.args.max_num_seqs, max_blocks, self.max_model_len, self.device)
        graphs.capture()
        return graphs

    # --- a step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> torch.Tensor:
        """Run the step's block moves and one forward over every scheduled sequence;
        returns float32 logits, one row per sequence that completes its prompt this step,
        in scheduled order."""
        # Order matters (see SchedulerOutput): a block freed by one move may be the
        # destination of a later one.
        self.kv_cache.swap_out(out.swap_out)
        self.kv_cache.copy_blocks(out.block_copies)
        self.kv_cache.swap_in(out.swap_in)
        if out.is_empty:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        inputs = pack_step(out, block_tables, self.block_size)
        if self.step_timings is not None:
            self.step_timings.phase("prepare")
        logits = self._forward(inputs)
        if self.step_timings is not None:
            self.step_timings.phase("forward")
        return logits

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None and inputs.is_decode_only and self.graphs.fits(inputs.seq_lens.shape[0]):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.seq_lens, inputs.block_tables)
        else:
            hidden = self.model(*self._eager_tensors(inputs))
        if inputs.logits_indices.numel() == 0:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[_to(inputs.logits_indices, self.device)]).float()

    def _eager_tensors(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=_to(inputs.slots, dev),
            block_tables=_to(inputs.block_tables, dev),
            query_start_loc=_to(inputs.query_start_loc, dev),
            seq_lens=_to(inputs.seq_lens, dev),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
        )
        return _to(inputs.input_ids, dev), _to(inputs.positions, dev), metadata


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
