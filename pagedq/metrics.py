"""Prometheus metrics: the one list of names, vLLM's with a `pagedq:` prefix.

The worker (`WorkerMetrics`, served on `PAGEDQ_METRICS_PORT`): the engine's gauges and
counters (read from the `LLMEngine.stats()` snapshot the worker takes every step anyway),
per-request latencies (from `RequestOutput.metrics`, the clock starting when the job was
enqueued), queue depths (from the worker's per-step Redis round trip) and job outcomes.
The worker's loop only bumps plain numbers: metric families are built when scraped, in
the HTTP server's thread.

The api (`ApiMetrics`, GET /metrics): requests by route and status, jobs submitted,
batches created, and queue depths read from Redis at scrape time.

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
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pagedq.outputs import RequestMetrics

PREFIX = "pagedq:"
# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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


class PlainHistogram:
    """Bucket counts and a sum as plain numbers: observing is a bisect and two additions,
    cheap enough to do for every generated token in the worker's loop."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name = name
        self.documentation = documentation
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        return HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=total)


class WorkerMetrics(Collector):
    def __init__(self, queue_names: list[str]):
        self.engine_stats: dict[str, int | float] = {}
        self.queue_depth = dict.fromkeys(queue_names, 0)
        self.jobs_finished = 0
        self.jobs_failed = 0
        self.jobs_requeued = 0
        self.time_to_first_token = PlainHistogram(
            PREFIX + "time_to_first_token_seconds", "From enqueue to the first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = PlainHistogram(
            PREFIX + "inter_token_latency_seconds", "Between two tokens of a request.", ITL_BUCKETS)
        self.e2e_request_latency = PlainHistogram(
            PREFIX + "e2e_request_latency_seconds", "From enqueue to the last token.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = PlainHistogram(
            PREFIX + "request_queue_time_seconds", "From enqueue to the engine's first step of the request "
            "(the Redis queue and the engine's waiting queue).", REQUEST_LATENCY_BUCKETS)

    def observe_finished(self, metrics: RequestMetrics, enqueued_at: float) -> None:
        """A job finished: its latencies, measured from when it was enqueued."""
        self.jobs_finished += 1
        if metrics.first_token_time is not None:
            self.time_to_first_token.observe(max(0.0, metrics.first_token_time - enqueued_at))
        if metrics.first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, metrics.first_scheduled_time - enqueued_at))
        if metrics.finished_time is not None:
            self.e2e_request_latency.observe(max(0.0, metrics.finished_time - enqueued_at))

    def collect(self) -> Iterator[Metric]:
        stats = self.engine_stats
        for name, (documentation, keys) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, documentation, value=sum(stats.get(key, 0) for key in keys))
        for name, (documentation, keys) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, documentation, value=sum(stats.get(key, 0) for key in keys))
        yield _queue_depth_family(self.queue_depth)
        for name, documentation, value in (
            ("jobs_finished", "Jobs this worker finished.", self.jobs_finished),
            ("jobs_failed", "Jobs that failed on this worker for good (no retry left).", self.jobs_failed),
            ("jobs_requeued", "Jobs this worker put back in the queue: failed with retries left, "
             "abandoned by a dead worker, or unfinished at shutdown.", self.jobs_requeued),
        ):
            yield CounterMetricFamily(PREFIX + name, documentation, value=value)
        for histogram in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                          self.request_queue_time):
            yield histogram.family()

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


class ApiMetrics:
    def __init__(self, queue_depths: Callable[[], dict[str, int]]):
        """`queue_depths`: reads each queue's length from Redis, at scrape time."""
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
        self.registry.register(self.queue_depths)

    def exposition(self) -> bytes:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        # Several api processes (`pagedq api --workers N`): every process's counters, summed.
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self.queue_depths)
        return generate_latest(registry)
