"""EngineArgs: how an engine is built. One definition shared by `LLM`, the worker and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, fields

from scheduler import PREEMPTION_MODES, PreemptionMode


@dataclass
class EngineArgs:
    model: str
    # "auto": the checkpoint's dtype on CUDA, float32 on CPU (CPUs lack fast bf16 matmuls).
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    # Most sequences one request may run side by side (n, beam_width); None: max_num_seqs, as
    # in vLLM. A service sets less (Settings.seqs_per_request), so one request leaves room.
    max_seqs_per_request: int | None = None
    # Tokens one step may process; prompts longer than this are prefilled in chunks.
    max_num_batched_tokens: int = 2048
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    gpu_memory_utilization: float = 0.9
    # KV cache byte budget when running on CPU, where there is no device memory to measure.
    cpu_kv_cache_bytes: int = 1 << 30
    # Fraction of blocks kept free when admitting new requests, so admission does not
    # immediately force a preemption as the running sequences grow.
    watermark: float = 0.01
    attention_backend: str = "auto"
    # Decode runs eagerly instead of replaying CUDA graphs.
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    # What a sequence preempted for lack of KV blocks does: recompute its KV later, or
    # move its blocks to `swap_space` GiB of CPU memory (falling back to recompute when full).
    preemption_mode: PreemptionMode = "recompute"
    swap_space: float = 4.0
    kv_cache_dtype: str = "auto"
    # Overlapped steps: the host schedules and prepares step N+1 while the device runs
    # step N (pagedq.core.engine_core). None: on for CUDA, off for CPU (where the device
    # is the host's own cores and nothing runs beside it).
    async_scheduling: bool | None = None
    # Run the engine core in a process of its own (pagedq.front.core_client): the front's
    # detokenization and output processing then run beside the core's steps.
    core_process: bool = False
    # The core process's nice value (lower runs first), None: the front's. The front, the
    # api, Redis and clients may share the core's CPUs; a core preempted mid-step delays
    # every sequence of the step, while they can wait a few milliseconds. Below the
    # front's own value it needs CAP_SYS_NICE (or RLIMIT_NICE); without, the core keeps
    # the front's priority and says so. Below the front's, it holds while the core runs at
    # least a quarter of max_num_seqs (pagedq.core.process.BatchPriority).
    core_nice: int | None = None
    # Real-time scheduling (SCHED_FIFO at this priority, 1-99) for the core process and every
    # thread and process it starts (torch's, zmq's, tensor-parallel ranks); None: normal
    # scheduling. A nice value still lets the front, api, Redis and clients preempt a step
    # (on 2 CPUs the core was preempted ~1 ms in each 5.7 ms step); at real-time priority
    # they wait for it. Only where the core's threads leave CPUs for them: the kernel keeps
    # just 5% of each CPU (sched_rt_runtime_us) for others while it computes. Needs
    # CAP_SYS_NICE (or RLIMIT_RTPRIO); without, the core keeps normal scheduling and says so.
    core_realtime_priority: int | None = None
    # Benchmarks only (`pagedq bench host`): the forward returns fixed logits and costs
    # nothing, so a run measures the host's own cost per step (worker.models.stub).
    stub_forward: bool = False
    # Ranks the model is split across (worker.tp): attention and KV heads, MLP columns and
    # the vocabulary; rank 0 runs in the engine core, the others in processes of their own.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        checks = {
            "block_size": self.block_size >= 1,
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_seqs_per_request": self.max_seqs_per_request is None or self.max_seqs_per_request >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "num_gpu_blocks_override": self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
            "gpu_memory_utilization": 0.0 < self.gpu_memory_utilization <= 1.0,
            "cpu_kv_cache_bytes": self.cpu_kv_cache_bytes > 0,
            "watermark": 0.0 <= self.watermark < 1.0,
            "preemption_mode": self.preemption_mode in PREEMPTION_MODES,
            "swap_space": self.swap_space >= 0,
            "max_model_len": self.max_model_len is None or self.max_model_len >= 1,
            "tensor_parallel_size": self.tensor_parallel_size >= 1,
            "core_nice": self.core_nice is None or -20 <= self.core_nice <= 19,
            "core_realtime_priority": self.core_realtime_priority is None or 1 <= self.core_realtime_priority <= 99,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: invalid value {getattr(self, name)!r}")
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            # An overlapped step reads the tokens the step before sampled from rank 0's
            # device; the other ranks never see them (sampling runs on rank 0 alone).
            raise ValueError("async_scheduling: overlapped steps need tensor_parallel_size 1")

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * (1 << 30))

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
