"""Prometheus metrics: the one list of names.

The worker (`WorkerMetrics`, served on `PAGEDQ_METRICS_PORT`) exposes every metric of
vLLM V1's Prometheus logger under vLLM's name, with its `model_name` and `engine` labels,
so vLLM's Grafana dashboard works unchanged; the prefix is `pagedq:` or, with
`PAGEDQ_METRICS_PREFIX=vllm`, vLLM's own `vllm:`. They are read from the engine's
`LLMEngine.stats()` snapshot the worker takes every step anyway (gauges, counters, tokens
per step) and from each finished request (`RequestOutput.metrics`, latencies counted from
when the job was enqueued; its token counts and parameters). pagedq's own job metrics
(queue depths, jobs finished / failed / requeued) keep the `pagedq:` prefix. The
worker's loop only bumps plain numbers: metric families are built when scraped, in the
HTTP server's thread.

The api (`ApiMetrics`, GET /metrics): requests by route and status, jobs submitted,
batches created, queue depths read from Redis at scrape time, and every live worker's
series, scraped then and summed across workers (`aggregate_workers`), so one scrape
target shows the whole service as `vllm serve`'s /metrics shows its engines.

Each process has its own registry (several apps may share a test process).
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pagedq.outputs import RequestOutput

PREFIX = "pagedq:"
METRICS_PREFIXES = ("pagedq", "vllm")
# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's finished_reason label values of request_success_total.
FINISH_REASONS = ("stop", "length", "abort")

# Engine stats (LLMEngine.stats() keys) exposed as gauges / counters: name -> (help, key or keys summed).
_ENGINE_GAUGES = {
    "num_requests_running": ("Requests in the engine's running queue.", ("num_running",)),
    "num_requests_waiting": ("Requests waiting in the engine for KV cache or batch room.", ("num_waiting",)),
    "num_requests_swapped": ("Requests swapped out to CPU memory.", ("num_swapped",)),
    "kv_cache_usage_perc": ("Fraction of the KV cache's blocks in use (1 = full).", ("kv_cache_usage",)),
}
_ENGINE_COUNTERS = {
    "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache at admission.", ("prefix_cache_queries",)),
    "prefix_cache_hits": ("Of those, tokens whose KV the prefix cache already held.", ("prefix_cache_hits",)),
    "prompt_tokens": ("Prompt tokens computed (prefix-cache hits excluded, recomputation after preemption included).",
                      ("prompt_tokens_computed",)),
    "generation_tokens": ("Tokens generated.", ("generation_tokens",)),
    "num_preemptions": ("Preemptions (recompute and swap).", ("num_preemptions_recompute", "num_preemptions_swap")),
}


def _1_2_5_buckets(largest: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to `largest`."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > largest:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class PlainHistogram:
    """Bucket counts and a sum as plain numbers: observing is a bisect and two additions,
    cheap enough to do for every generated token in the worker's loop."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], labels: dict[str, str] | None = None):
        self.name = name
        self.documentation = documentation
        self.bounds = buckets
        self.labels = labels or {}
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), cumulative, sum_value=total)
        return family


class WorkerMetrics(Collector):
    def __init__(self, queue_names: list[str], model_name: str, max_model_len: int, cache_config: dict[str, str],
                 prefix: str = "pagedq"):
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.prefix = f"{prefix}:"
        self.labels = {"model_name": model_name, "engine": "0"}
        self.max_model_len = max_model_len
        self.cache_config = cache_config
        self.engine_stats: dict[str, int | float] = {}
        self._tokens_computed = 0
        self.queue_depth = dict.fromkeys(queue_names, 0)
        self.jobs_finished = 0
        self.jobs_failed = 0
        self.jobs_requeued = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        token_buckets = _1_2_5_buckets(max_model_len)
        histograms = {
            "time_to_first_token_seconds": ("From enqueue to the first generated token.", TTFT_BUCKETS),
            "inter_token_latency_seconds": ("Between two tokens of a request.", ITL_BUCKETS),
            "time_per_output_token_seconds": ("A request's decode time per output token after the first "
                                              "(vLLM's older name of request_time_per_output_token_seconds).", ITL_BUCKETS),
            "request_time_per_output_token_seconds": ("A request's decode time per output token after the first.",
                                                      ITL_BUCKETS),
            "e2e_request_latency_seconds": ("From enqueue to the last token.", REQUEST_LATENCY_BUCKETS),
            "request_queue_time_seconds": ("From enqueue to the engine's first step of the request "
                                           "(the Redis queue and the engine's waiting queue).", REQUEST_LATENCY_BUCKETS),
            "request_inference_time_seconds": ("From the engine's first step of the request to its last token.",
                                               REQUEST_LATENCY_BUCKETS),
            "request_prefill_time_seconds": ("From the engine's first step of the request to its first token.",
                                             REQUEST_LATENCY_BUCKETS),
            "request_decode_time_seconds": ("From a request's first token to its last.", REQUEST_LATENCY_BUCKETS),
            "request_prompt_tokens": ("Prompt tokens of each finished request.", token_buckets),
            "request_generation_tokens": ("Tokens generated for each finished request (all its n outputs).",
                                          token_buckets),
            "request_max_num_generation_tokens": ("The longest of a finished request's n outputs, in tokens.",
                                                  token_buckets),
            "request_params_n": ("The n of each finished request.", N_BUCKETS),
            "request_params_max_tokens": ("The max_tokens of each finished request (none: what the context leaves).",
                                          token_buckets),
            "iteration_tokens_total": ("Tokens (prompt and generated) computed by each engine step.",
                                       ITERATION_TOKEN_BUCKETS),
        }
        self.histograms = {name: PlainHistogram(self.prefix + name, documentation, buckets, self.labels)
                           for name, (documentation, buckets) in histograms.items()}
        # The two the worker's loop feeds directly.
        self.inter_token_latency = self.histograms["inter_token_latency_seconds"]

    def observe_step(self, stats: dict[str, int | float]) -> None:
        """The engine's stats after a step: the step's computed tokens go to iteration_tokens_total."""
        computed = int(stats.get("tokens_computed", 0))
        if computed > self._tokens_computed:
            self.histograms["iteration_tokens_total"].observe(computed - self._tokens_computed)
        self._tokens_computed = computed
        self.engine_stats = stats

    def observe_finished(self, output: RequestOutput, enqueued_at: float, n: int, max_tokens: int | None) -> None:
        """A job finished: its latencies, measured from when it was enqueued, token counts and parameters."""
        self.jobs_finished += 1
        metrics, observe = output.metrics, self._observe
        reason = output.outputs[0].finish_reason if output.outputs else None
        if reason in self.request_success:
            self.request_success[reason] += 1
        first_token, scheduled, finished = metrics.first_token_time, metrics.first_scheduled_time, metrics.finished_time
        if first_token is not None:
            observe("time_to_first_token_seconds", first_token - enqueued_at)
        if scheduled is not None:
            observe("request_queue_time_seconds", scheduled - enqueued_at)
        if finished is not None:
            observe("e2e_request_latency_seconds", finished - enqueued_at)
        if scheduled is not None and finished is not None:
            observe("request_inference_time_seconds", finished - scheduled)
        if scheduled is not None and first_token is not None:
            observe("request_prefill_time_seconds", first_token - scheduled)
        lengths = [len(completion.token_ids) for completion in output.outputs]
        if first_token is not None and finished is not None:
            observe("request_decode_time_seconds", finished - first_token)
            if max(lengths, default=0) > 1:
                per_token = (finished - first_token) / (max(lengths) - 1)
                observe("time_per_output_token_seconds", per_token)
                observe("request_time_per_output_token_seconds", per_token)
        prompt_tokens = len(output.prompt_token_ids)
        observe("request_prompt_tokens", prompt_tokens)
        observe("request_generation_tokens", sum(lengths))
        observe("request_max_num_generation_tokens", max(lengths, default=0))
        observe("request_params_n", n)
        observe("request_params_max_tokens", max_tokens if max_tokens is not None else self.max_model_len - prompt_tokens)

    def _observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(max(0.0, value))

    def collect(self) -> Iterator[Metric]:
        stats, names, values = self.engine_stats, list(self.labels), list(self.labels.values())
        for name, (documentation, keys) in _ENGINE_GAUGES.items():
            family = GaugeMetricFamily(self.prefix + name, documentation, labels=names)
            family.add_metric(values, sum(stats.get(key, 0) for key in keys))
            yield family
        for name, (documentation, keys) in _ENGINE_COUNTERS.items():
            family = CounterMetricFamily(self.prefix + name, documentation, labels=names)
            family.add_metric(values, sum(stats.get(key, 0) for key in keys))
            yield family
        success = CounterMetricFamily(self.prefix + "request_success", "Finished requests, by finish reason.",
                                      labels=[*names, "finished_reason"])
        for reason, count in self.request_success.items():
            success.add_metric([*values, reason], count)
        yield success
        info = GaugeMetricFamily(self.prefix + "cache_config_info", "The KV cache's configuration (value 1).",
                                 labels=list(self.cache_config))
        info.add_metric(list(self.cache_config.values()), 1)
        yield info
        for histogram in list(self.histograms.values()):
            yield histogram.family()
        yield _queue_depth_family(self.queue_depth)
        for name, documentation, value in (
            ("jobs_finished", "Jobs this worker finished.", self.jobs_finished),
            ("jobs_failed", "Jobs that failed on this worker for good (no retry left).", self.jobs_failed),
            ("jobs_requeued", "Jobs this worker put back in the queue: failed with retries left, "
             "abandoned by a dead worker, or unfinished at shutdown.", self.jobs_requeued),
        ):
            yield CounterMetricFamily(PREFIX + name, documentation, value=value)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics from a daemon thread; returns the port (useful when `port` is 0)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        server, _ = start_http_server(port, addr=host, registry=registry)
        return server.server_port


def _queue_depth_family(depths: dict[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + "queue_depth", "Jobs waiting in the Redis queue.", labels=["queue"])
    for queue, depth in depths.items():
        family.add_metric([queue], depth)
    return family


class _QueueDepths(Collector):
    def __init__(self, read: Callable[[], dict[str, int]]):
        self.read = read

    def describe(self) -> Iterator[Metric]:
        yield _queue_depth_family({})  # the name, without reading Redis at registration

    def collect(self) -> Iterator[Metric]:
        yield _queue_depth_family(self.read())


def aggregate_workers(pages: list[str]) -> list[Metric]:
    """Workers' /metrics pages as one: each series (name and labels) summed across workers,
    as counters, histograms and counts of requests add up; fractions (kv_cache_usage_perc)
    averaged, info gauges (value 1) kept once. The queue depths are left out: the api reads
    them from Redis itself."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, list[float]]] = {}
    for page in pages:
        for family in text_string_to_metric_families(page):
            if family.name == PREFIX + "queue_depth":
                continue
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                values.setdefault(family.name, {}).setdefault(key, []).append(sample.value)
    for name, family in families.items():
        for (sample_name, labels), numbers in values[name].items():
            if name.endswith("_perc"):
                value = sum(numbers) / len(numbers)
            elif name.endswith("_info"):
                value = max(numbers)
            else:
                value = sum(numbers)
            family.add_sample(sample_name, dict(labels), value)
    return list(families.values())


class ApiMetrics:
    def __init__(self, queue_depths: Callable[[], dict[str, int]], workers: Collector | None = None):
        """`queue_depths`: reads each queue's length from Redis, at scrape time; `workers`:
        the live workers' series, scraped at scrape time too."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            PREFIX + "api_requests", "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"], registry=self.registry,
        )
        self.request_duration = Histogram(
            PREFIX + "api_request_duration_seconds", "Time to answer an HTTP request (streams: until the last byte).",
            ["route"], buckets=HTTP_LATENCY_BUCKETS, registry=self.registry,
        )
        self.jobs_submitted = Counter(
            PREFIX + "jobs_submitted", "Jobs enqueued, by queue.", ["queue"], registry=self.registry
        )
        self.batches_created = Counter(PREFIX + "batches_created", "Batches created.", registry=self.registry)
        self.queue_depths = _QueueDepths(queue_depths)
        self.workers = workers
        self.registry.register(self.queue_depths)
        if workers is not None:
            self.registry.register(workers)

    def exposition(self) -> bytes:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        # Several api processes (`pagedq api --workers N`): every process's counters, summed.
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self.queue_depths)
        if self.workers is not None:
            registry.register(self.workers)
        return generate_latest(registry)
