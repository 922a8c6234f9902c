"""The device side of a step: the KV cache's block moves, one forward over every scheduled
sequence (its inputs prepared by `InputBatch` from what changed), and sampling on the
device. It owns the model, the paged KV cache, the persistent input batch, the sampler
and the CUDA graphs; the engine core tells it what to run (worker.input_batch.StepPlan)
and never waits for the device except to read a step's sampled ids.
"""

from __future__ import annotations

import logging
import time

import torch

from kernels import get_attention_backend
from pagedq.config import EngineArgs
from scheduler import SchedulerOutput
from worker.cuda_graphs import DecodeGraphs
from worker.host_threads import limit_host_threads_for_gpu
from worker.input_batch import InputBatch, StepInputs, StepPlan
from worker.kv_cache import KVCache, kv_cache_dtype
from worker.models import check_tensor_parallel, load_model
from worker.models.stub import StubForward
from worker.sampler import DeviceSample, Sampler, SamplingRow
from worker.tp.group import SINGLE, TensorParallel
from worker.tp.leader import Ranks
from worker.tp.messages import MoveBlocks, RunForward

logger = logging.getLogger(__name__)


def _uniform_plan(num_seqs: int, query_len: int, context: int, block_size: int) -> StepPlan:
    """A step of `num_seqs` sequences in rows 0.., each computing its last `query_len` of
    `context` tokens (token id 0) in blocks 0.. (all of them the same blocks)."""
    blocks = list(range(-(-context // block_size)))
    rows = list(range(num_seqs))
    return StepPlan(
        rows=rows, starts=[context - query_len] * num_seqs, query_lens=[query_len] * num_seqs,
        token_ids=[0] * (num_seqs * query_len), pending_at=[], pending_from=[], logits_of=rows,
        changed_rows=[(row, blocks) for row in rows], owners=[None] * num_seqs,
    )

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's own message lists every device type it knows
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}") from None
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


class ModelRunner:
    """Under tensor parallelism (`tp`), this rank's shard of the model and of the KV cache.
    Rank 0's runner (the engine core's) leads: `ranks` sends each block move and forward
    to the other ranks before running it here (worker.tp.leader); theirs have no `ranks`."""

    def __init__(self, args: EngineArgs, hf_config, max_model_len: int, eos_token_ids: set[int],
                 tp: TensorParallel = SINGLE, ranks: Ranks | None = None):
        self.args = args
        self.tp = tp
        self.ranks = ranks
        self.device = tp.device(resolve_device(args.device))
        if self.device.type == "cuda":
            limit_host_threads_for_gpu()
        self.dtype = resolve_dtype(args.dtype, hf_config, self.device)
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.attention = get_attention_backend(args.attention_backend, self.device.type)
        self.model = load_model(args.model, self.dtype, self.device, self.attention, tp, hf_config)
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
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(self.max_blocks_per_seq, self.block_size, self.device, self.vocab_size,
                                      initial_rows=2 * args.max_num_seqs + 8)
        if self.device.type == "cuda" and self.attention.name == "triton" and not args.stub_forward:
            self.compile_served_shapes()
        if self.device.type == "cpu" and not args.stub_forward:
            self.build_cpu_kernels()
        self.sampler = Sampler(
            self.vocab_size, eos_token_ids, generator=torch.Generator(device=self.device).manual_seed(args.seed)
        )
        # The previous step's sampled ids, on the device: a sequence's next input token
        # when the host does not know it yet.
        self.last_sampled: torch.Tensor | None = None
        logger.info(
            "model on %s (%s), attention %s, KV cache %d blocks x %d tokens (%s), swap %d blocks, CUDA graphs: %s",
            self.device, self.dtype, self.attention.name, self.num_blocks, self.block_size, self.cache_dtype,
            self.num_cpu_blocks, self.graphs.sizes if self.graphs else "off",
        )

    @classmethod
    def create(cls, args: EngineArgs, hf_config, max_model_len: int, eos_token_ids: set[int]) -> ModelRunner:
        """The engine core's runner: on one device, or rank 0 of `tensor_parallel_size`
        ranks, the others started here."""
        if args.tensor_parallel_size == 1:
            return cls(args, hf_config, max_model_len, eos_token_ids)
        check_tensor_parallel(hf_config, args.tensor_parallel_size)
        ranks = Ranks(args, hf_config, max_model_len, resolve_device(args.device).type)
        try:
            return cls(args, hf_config, max_model_len, eos_token_ids, ranks.tp, ranks)
        except BaseException:
            ranks.shutdown()
            raise

    def shutdown(self) -> None:
        """Stops the other ranks, if any (also done when the runner is collected)."""
        if self.ranks is not None:
            self.ranks.shutdown()

    def check_alive(self) -> None:
        """Raises TensorParallelError if one of the other ranks has died."""
        if self.ranks is not None:
            self.ranks.check_alive()

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
        # Every rank holds the same blocks (of its own heads): as many as the fullest device allows.
        num_blocks = self.tp.agree_min(int(min(budget // bytes_per_block, useful)), self.device)
        if num_blocks < 1:
            raise ValueError("the KV cache budget is too small for a single block")
        return num_blocks

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
        batch = InputBatch(scratch_blocks, self.block_size, self.device, self.vocab_size, initial_rows=1)
        with torch.inference_mode():
            self._run_model(batch.prepare(_uniform_plan(1, num_tokens, num_tokens, self.block_size), None))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        self.model.bind_kv_caches([(None, None)] * self.model.num_layers)
        torch.cuda.empty_cache()
        # Logits, probabilities and noise of a full batch of sampling rows, in float32.
        sampler_bytes = 4 * self.args.max_num_seqs * self.vocab_size * 4
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, int(total * self.args.gpu_memory_utilization) - peak - sampler_bytes)

    def compile_served_shapes(self) -> None:
        """One forward of each class of batch a served step can be, so that Triton compiles
        their kernel variants now rather than in a served step, every running request
        stalled meanwhile (a fresh H200 spent 0.89 s of its first served run's 2.4 s of
        steps compiling; the cache sizing's forward and the decode graphs' capture cover
        one prefill shape and pure decode only). The attention kernel's variants follow
        the batch's longest query (its row tiles), its number of sequences and its longest
        context (how many slices a context is split into): powers of two of each, within
        the step's token budget. The batches are garbage in the real cache's blocks, which
        no request holds yet; the block table is as wide as the engine's, so every stride
        is specialised as in service. Later starts find the variants in Triton's disk cache."""
        budget = self.args.max_num_batched_tokens
        longest = min(self.max_model_len, self.num_blocks * self.block_size, 4096)
        contexts = sorted({min(longest, 128 << i) for i in range(6)})
        batch = InputBatch(self.max_blocks_per_seq, self.block_size, self.device, self.vocab_size,
                           initial_rows=self.args.max_num_seqs)
        started, forwards = time.perf_counter(), 0
        with torch.inference_mode():
            for query_len in (1, 2, 4, 8, 16, 32, 64):
                num_seqs = 1
                while num_seqs <= self.args.max_num_seqs and num_seqs * query_len <= budget:
                    for context in contexts:
                        if context >= query_len:
                            self._run_model(batch.prepare(_uniform_plan(num_seqs, query_len, context, self.block_size), None))
                            forwards += 1
                    num_seqs *= 2
        self.synchronize()
        logger.info("compiled the kernels of served batch shapes: %d forwards in %.1f s", forwards, time.perf_counter() - started)

    def build_cpu_kernels(self) -> None:
        """oneDNN builds a kernel per linear shape and row count the first time a step meets
        it (worker.models.layers), and a new service's first steps meet them all: serving
        512 requests on the tiny model, a decode step that met a new count cost 10.5 ms of
        the engine core's CPU against 2.5 for one that did not. The cheap counts are built
        now: a step's tokens go through each layer's projections, one row per sampled
        sequence through the output embedding."""
        started = time.perf_counter()
        with torch.inference_mode():
            built = self.model.build_cpu_kernels(self.args.max_num_batched_tokens, self.args.max_num_seqs)
        logger.info("built %d oneDNN linear kernels ahead in %.2f s", built, time.perf_counter() - started)

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        if self.device.type != "cuda" or self.args.enforce_eager or self.attention.name != "triton" or self.args.stub_forward:
            return None
        max_blocks = -(-self.max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, self.args.max_num_seqs, max_blocks, self.max_model_len, self.device)
        graphs.capture()
        return graphs

    # --- a step (called inside the engine core's inference mode: one per step, not one per call) ---

    def move_blocks(self, out: SchedulerOutput | MoveBlocks) -> None:
        """The step's KV block moves, queued before its forward. Order matters (see
        SchedulerOutput): a block freed by one move may be the destination of a later one."""
        if self.ranks is not None:
            moves = MoveBlocks(out.swap_out, out.block_copies, out.swap_in)
            return self.ranks.run(moves, lambda: self._move_blocks(moves))
        self._move_blocks(out)

    def _move_blocks(self, out: SchedulerOutput | MoveBlocks) -> None:
        self.kv_cache.swap_out(out.swap_out)
        self.kv_cache.copy_blocks(out.block_copies)
        self.kv_cache.swap_in(out.swap_in)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """One forward over the plan's sequences: float32 logits [len(plan.logits_of) +
        len(plan.extra_logits), vocab] on the device (queued, not waited for)."""
        if self.ranks is not None:
            return self.ranks.run(RunForward.of(plan), lambda: self._forward(plan))
        return self._forward(plan)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        inputs = self.input_batch.prepare(plan, self.last_sampled)
        if self.step_timings is not None:
            self.step_timings.phase("prepare")
        logits = self._run_model(inputs)
        if self.step_timings is not None:
            self.step_timings.phase("forward")
        return logits

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> DeviceSample:
        """The rows' tokens (row i reads logits row i), queued on the device; their copy
        to the host starts at once, behind them."""
        sample = self.sampler.sample(logits, rows)
        sample.start_copy()
        return sample

    def top_logprobs(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Beam search's candidates: the k highest log-probabilities of each row and their ids."""
        top = logits.log_softmax(dim=-1).topk(min(k, logits.shape[1]), dim=-1)
        return top.values, top.indices

    def synchronize(self) -> None:
        """Wait for everything queued on the device."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run_model(self, inputs: StepInputs) -> torch.Tensor:
        md = inputs.metadata
        if self.graphs is not None and inputs.is_decode_only and self.graphs.fits(md.num_seqs):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, md.slot_mapping, md.seq_lens, md.block_tables)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, md)
        if inputs.logits_indices.numel() == 0:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[inputs.logits_indices]).float()
