"""The service's one configuration object: every knob of the api, worker and CLI.

Values come from `PAGEDQ_*` environment variables (e.g. `PAGEDQ_REDIS_URL`,
`PAGEDQ_API_KEYS=key1,key2`); CLI flags override them through `Settings.with_overrides`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def default_api_workers() -> int:
    """One api process per four cores, one to four. The api's event loop is one core: a
    burst of submissions waits for it (on a 16-core H200 host, 256 POSTs at once were all
    answered only after ~290 ms of parsing, the engine idle meanwhile), while the worker,
    its engine core and Redis each want a core of their own; on a small machine more api
    processes take turns with them (two on the 2-core CPU VM: `bench serve` +5%, `vllm bench
    serve` -10 to -13% and 10-18% more CPU; bench/results/2026-11-28-service-cpu-vs-vllm.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 4))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="forbid", validate_assignment=True)

    # Where things are.
    redis_url: str | None = Field(None, description="None: `pagedq up` launches a local Redis.")
    model: str | None = Field(None, description="Local Hugging Face checkpoint directory.")
    served_model_name: str | None = Field(
        None, description="The model's id on /v1 (default: the checkpoint directory's name; its path is accepted too)."
    )
    queue_name: str = Field("pagedq", pattern=r"^[A-Za-z0-9_.:-]+$")
    cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "pagedq",
        description="`pagedq up`'s tiny checkpoint and Redis data (AOF) live here.",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    disable_uvicorn_access_log: bool = Field(
        False, description="The api logs no line per HTTP request (vLLM's --disable-uvicorn-access-log): a line costs "
        "~30 us of the api's CPU, a tenth of a short request's.",
    )
    api_workers: int = Field(
        default_factory=default_api_workers, ge=1,
        description="api processes sharing the port (`pagedq api`, `pagedq up`); default: one per four of this "
        "machine's cores, at most four (one on up to seven cores).",
    )

    # Engine (worker side; max_model_len is also the api's length check).
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_seqs_per_request: int | None = Field(
        None, ge=1, description="Most sequences one request runs side by side (n, beam_width); None: half of "
        "max_num_seqs (128 of the default 256, OpenAI's own limit on n), so that one request never holds every "
        "engine slot while everyone else waits for it to end.",
    )
    num_gpu_blocks: int | None = Field(None, ge=1, description="Override the KV cache size in blocks.")
    torch_threads: int | None = Field(
        None, ge=1, description="The worker's torch CPU threads; None: on a CPU device all cores but one "
        "(the api, Redis and clients share the machine), else torch's default.",
    )
    # More engine knobs, named as in EngineArgs; None keeps EngineArgs' default (and
    # EngineArgs checks the values).
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str | None = Field(None, description="auto, or fp8 (e4m3: twice the tokens per GiB of bf16).")
    enable_prefix_caching: bool | None = None
    preemption_mode: str | None = Field(None, description="recompute or swap.")
    swap_space: float | None = Field(None, description="GiB of CPU memory for swapped-out KV blocks.")
    attention_backend: str | None = Field(None, description="auto, cpu, torch or triton.")
    enforce_eager: bool | None = Field(None, description="Decode without CUDA graphs.")
    async_scheduling: bool | None = Field(
        None, description="Overlapped engine steps (the next step launched before the last one's tokens are read); "
        "default on for CUDA, off for CPU.",
    )
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="Devices one worker's engine splits the model across (tensor parallelism: one "
        "process per rank, rank r on GPU r; gloo on CPU).",
    )
    core_process: bool | None = Field(
        None, description="Run the engine core in a process of its own (the worker's default; LLM's is in-process).",
    )
    core_nice: int | None = Field(
        -10, ge=-20, le=19, description="The engine core process's nice value (lower runs first; None: the "
        "worker's own): the api, Redis and the worker's own Python share its CPUs and can wait, its steps "
        "cannot. Below the worker's, it holds while the core runs at least a quarter of max_num_seqs; with "
        "fewer, the core runs at the worker's priority (the api and worker admitting more go first). Needs "
        "CAP_SYS_NICE (compose.yaml adds it); without, the core keeps the worker's priority.",
    )
    core_realtime_priority: int | None = Field(
        None, ge=1, le=99, description="Real-time scheduling (SCHED_FIFO at this priority) for the engine core "
        "process and its threads (None: normal): the api, Redis and the worker's own Python then wait for its "
        "steps instead of preempting them (+2-30% throughput in 8 of 8 pairs on a 2-core CPU host, "
        "bench/results/2026-11-28-service-cpu-vs-vllm.md). Only where its threads leave CPUs for the rest; "
        "needs CAP_SYS_NICE.",
    )

    # Client side (`pagedq submit/result/cancel`).
    url: str | None = Field(None, description="The api's base URL; default http://{host}:{port}.")
    api_key: SecretStr | None = Field(None, description="The key the CLI sends.")

    # Limits.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Comma-separated; each key is a tenant of its own: its jobs, files and "
        "batches are invisible to every other key (404).",
    )
    tenant_keys: dict[str, list[SecretStr]] = Field(
        default_factory=dict, description='JSON {"tenant": ["key", ...]}: the keys of a named tenant, which share '
        "its jobs, files and batches.",
    )
    admin_api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Comma-separated; these keys see and act on every tenant's jobs, files and batches.",
    )
    probes_require_key: bool = Field(False, description="GET /metrics and /ready need a key too (/health never does).")
    max_queue_depth: int = Field(10_000, ge=1, description="Queued jobs beyond this get 429.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429.")
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1)
    max_wait_s: float = Field(60.0, gt=0, description="Upper bound of GET /result?wait=.")
    redis_max_connections: int = Field(
        64, ge=2, description="Redis connections one api process holds at most; requests beyond wait for one "
        "(redis_pool_timeout_s, then 503).",
    )
    redis_pool_timeout_s: float = Field(10.0, gt=0)
    api_requests_per_turn: int = Field(
        32, ge=1, description="Requests an api process starts per turn of its event loop (api/turns.py): a burst "
        "arriving at once lets Redis replies and open streams through after each share, instead of holding them "
        "until the whole burst is parsed.",
    )
    completion_timeout_s: float = Field(
        600.0, gt=0, description="Non-streaming /v1 completions wait this long for their job; then it is canceled (504).",
    )

    # Tool calling on /v1/chat/completions (vLLM's flags of the same names).
    enable_auto_tool_choice: bool = Field(
        False, description='tool_choice "auto" (the default when a request gives tools): the model decides, and its '
        "calls are parsed out of its text by tool_call_parser. Off: such requests are refused (400), as vLLM refuses "
        'them; "required" and named tool choices work either way.',
    )
    tool_call_parser: Literal["llama3_json", "hermes", "mistral"] | None = Field(
        None, description="How the model writes tool calls: llama3_json (Llama 3.1-3.3), hermes (Hermes, Qwen 2.5/3), "
        "mistral ([TOOL_CALLS]).",
    )

    structured_outputs_disable_any_whitespace: bool = Field(
        False, description="JSON structured outputs (json, json_object, response_format, forced tool calls) without "
        "whitespace between tokens unless a request asks otherwise (vLLM's --structured-outputs-config."
        "disable_any_whitespace): small models given the freedom often write whitespace until max_tokens.",
    )

    # Batch API (/v1/files, /v1/batches).
    files_dir: Path | None = Field(
        None, description="Where uploaded and batch output files live; None: in Redis. Every api replica must see it.",
    )
    max_file_bytes: int = Field(100 << 20, ge=1, description="Largest file POST /v1/files accepts.")
    max_batch_requests: int = Field(50_000, ge=1, description="Most requests (lines) in one batch input file.")
    # The api tokenizes a summary document whole to plan its chunks, at ~300 bytes of memory a
    # character: a 30 MB document took the api down, and again at every restart.
    max_document_chars: int = Field(
        1_000_000, ge=1, description="Longest summary document (characters) a batch line may carry; a longer one "
        "fails its line.",
    )
    files_ttl_s: int = Field(30 * 24 * 3600, ge=60, description="Files and batch records are kept this long.")
    batch_priority: int = Field(10, description="Engine priority of batch requests (interactive ones default to 0; lower runs first).")
    reserved_interactive_slots: int = Field(
        16, ge=0, description="Of each worker's capacity, slots batch jobs never take (at least one is left to batches).",
    )
    batch_poll_interval_s: float = Field(2.0, gt=0, description="How often the api advances the batches in progress.")
    retention_sweep_interval_s: float = Field(
        600.0, gt=0, description="How often each api prunes the indexes that outlive expired jobs, files and batches.",
    )

    # Job lifetimes.
    result_ttl_s: int = Field(24 * 3600, ge=1)
    job_timeout_s: int = Field(3600, ge=1)
    job_retries: int = Field(2, ge=0, description="Requeues after a worker dies mid-job.")
    stream_ttl_s: int = Field(24 * 3600, ge=1)

    # Worker loop.
    max_inflight: int = Field(256, ge=1, description="Jobs one worker holds at once (also bounded by the engine).")
    heartbeat_ttl_s: int = Field(15, ge=2, description="A dead worker's jobs are requeued this long after its last beat.")
    reaper_interval_s: float = Field(2.0, gt=0)
    # 1 s, not the 0.2 s it was: such a job's partial result is read now and then by a
    # poller (a long poll or an OpenAI call without stream reads only the end), and each delta
    # costs the worker an output built, a fenced XADD and its announcement; at 0.2 s they were
    # ~15% of the worker's CPU and ~20% of Redis's with polling clients on the tiny model.
    progress_interval_s: float = Field(
        1.0, ge=0, description="Min seconds between the deltas (the partial result) of a job nobody streams "
        "(JobPayload.stream false: OpenAI calls without stream, batch lines); its tokens come from the engine "
        "core in chunks as often.",
    )
    stream_interval_s: float = Field(
        0.0, ge=0, description="Min seconds between one job's streamed deltas after its first token (0: every engine step)."
    )
    drain_timeout_s: float = Field(10.0, ge=0, description="SIGTERM: finish in-flight jobs for this long, then requeue.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="The worker serves Prometheus /metrics on PAGEDQ_HOST at this port "
        "(None: off; 0: any free port, shown by GET /ready).",
    )
    metrics_prefix: Literal["pagedq", "vllm"] = Field(
        "pagedq", description="Prefix of the worker's vLLM-named metrics: `pagedq:`, or vLLM's own `vllm:` "
        "(for dashboards written against vLLM).",
    )

    @model_validator(mode="after")
    def _auto_tool_choice_has_a_parser(self) -> Settings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs tool_call_parser (--tool-call-parser), as in vLLM")
        return self

    @field_validator("api_keys", "admin_api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    def with_overrides(self, **overrides: Any) -> Settings:
        """A copy with the given fields replaced; None means "not given" (a CLI flag left out)."""
        given = {name: value for name, value in overrides.items() if value is not None and name in type(self).model_fields}
        return self.model_validate({**self.model_dump(), **given})

    @property
    def seqs_per_request(self) -> int:
        """What max_seqs_per_request allows (the api and the workers' engines apply it alike)."""
        return self.max_seqs_per_request or max(1, self.max_num_seqs // 2)

    @property
    def base_url(self) -> str:
        return (self.url or f"http://{self.host}:{self.port}").rstrip("/")

    def to_env(self) -> dict[str, str]:
        """These settings as `PAGEDQ_*` variables, for child processes to read back."""
        env = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, list):
                value = ",".join(v.get_secret_value() if isinstance(v, SecretStr) else str(v) for v in value)
            elif isinstance(value, dict):
                value = json.dumps({
                    key: [v.get_secret_value() if isinstance(v, SecretStr) else v for v in items] for key, items in value.items()
                })
            env[f"PAGEDQ_{name.upper()}"] = str(value)
        return env

    @property
    def model_id(self) -> str:
        """The served model's id on /v1."""
        return self.served_model_name or Path(self.require_model()).name

    def require_model(self) -> str:
        if not self.model:
            raise ValueError("model: no checkpoint given (set PAGEDQ_MODEL or pass --model)")
        return self.model

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise ValueError("redis_url: no Redis given (set PAGEDQ_REDIS_URL or pass --redis-url)")
        return self.redis_url
